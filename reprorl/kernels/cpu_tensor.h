// What the kernels' source files take from torch: tensors, three factories, at::parallel_for
// and TORCH_CHECK. Not <torch/extension.h>, which cost about 25 s of every file's build on 2
// cores (these headers: 2 s); cpu_bindings.cpp holds the Python bindings.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
