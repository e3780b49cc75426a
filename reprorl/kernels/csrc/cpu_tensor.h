// What the kernels' source files take from torch: tensors, three factories, at::parallel_for
// and TORCH_CHECK. Not <torch/extension.h>: parsing its C++ frontend was most of each file's
// build, more than ten times these headers (docs/performance.md, the test suite);
// cpu_bindings.cpp holds the Python bindings.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
