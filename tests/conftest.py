"""Shared fixtures: the project's tokenizer, a tiny policy, the small runs' assets and one plain
run trained on them, rollout-shaped batches, a local Ray and whether one of its actors is dead,
worker groups of one rank in this process, the tolerance of gradients summed in another
grouping, and `reprorl compare`'s verdict on two runs.

The whole session runs torch's portable CPU kernels (`ATEN_CPU_CAPABILITY=default`), as a
full-determinism run does: a run inside this process must agree with one in a subprocess.

Without a CUDA device, Triton kernels run under its interpreter (on CPU tensors), so CI
checks their arithmetic; the variable must be set before triton is first imported.
"""

import contextlib
import os
import time

# torch's portable CPU kernels, as every full-determinism process runs them; the variable
# acts at torch's first CPU kernel, so before anything here computes.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from reprorl.models.tokenizer import make_char_tokenizer
from reprorl.protocol import Batch


@pytest.fixture(scope="session")
def char_tokenizer():
    """The tiny models' character-level ChatML tokenizer (vocab 128)."""
    return make_char_tokenizer()


def _ray_is_clean(ray, within_s: float = 5.0) -> bool:
    """Whether this Ray has no actor left (alive, restarting or still pending) and every CPU
    free, waiting up to `within_s` for kills already sent (`ray.kill` lands asynchronously)."""
    from ray._private import state

    deadline = time.monotonic() + within_s
    while True:
        left = [a for a in state.actors().values() if a["State"] != "DEAD"]
        if not left and ray.available_resources().get("CPU", 0.0) == ray.cluster_resources().get("CPU"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@pytest.fixture(scope="session")
def _ray_started_here():
    """{"started": whether `ray_local` started the Ray that is up}; that Ray stops at the session's end."""
    owner = {"started": False}
    yield owner
    if owner["started"]:
        import ray

        if ray.is_initialized():
            ray.shutdown()


@contextlib.contextmanager
def _without_run_variables():
    """os.environ without a run's own variables (REPRORL_SEED, REPRORL_FULL_DETERMINISM) for
    the block: Ray's processes inherit the environment it starts in, and the tests that
    check an actor refuses to start without them need a Ray that never had them."""
    from reprorl.determinism import ENV_FULL_DETERMINISM, ENV_SEED

    saved = {key: os.environ.pop(key) for key in (ENV_SEED, ENV_FULL_DETERMINISM) if key in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _environ_restored():
    """Every test leaves os.environ as it found it: a run trained in this process (`reprorl
    train` through cli.main) sets the run's determinism variables, and a Ray started after
    it would hand them to every actor."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def ray_local(_ray_started_here):
    """A local Ray (2 CPUs) for one test module, started if none is up.

    Modules never inherit each other's Ray state (its actors, its reserved CPUs), so each
    runs the same alone and in the full suite; but a Ray left clean (no actor left, every
    CPU free) is handed to the next module as it is, since starting and stopping one took
    5-10 s a module on 2 cores. One that is not clean is shut down: the next module starts
    a fresh one, as every module used to.
    """
    import ray

    if not ray.is_initialized():
        with _without_run_variables():
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        _ray_started_here["started"] = True
    yield ray
    if _ray_started_here["started"] and ray.is_initialized() and not _ray_is_clean(ray):
        ray.shutdown()


def _actor_dead(actor, within_s: float = 10.0) -> bool:
    """Whether a Ray `actor` is dead (its calls raise `RayActorError`) or becomes so within
    `within_s`: `ray.kill` reaches it through Ray's control store, not in call order. An
    actor that stays pending (never placed) is alive: Ray keeps its request."""
    import ray

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            return False
        time.sleep(0.1)
    return False


@pytest.fixture
def actor_dead():
    return _actor_dead


@pytest.fixture
def in_process_group():
    """`in_process_group(role, model_path, **options) -> WorkerGroup`: a group of one rank in
    this process (`WorkerGroup(in_process=True)`: the fit loop's training path without Ray),
    seed 0 and full determinism off unless given. The groups are shut down after the test,
    and torch's thread count, which a rank sets to its own, is restored."""
    from reprorl.workers.group import WorkerGroup

    threads = torch.get_num_threads()
    groups = []

    def make(role, model_path, **options):
        options = {"optim": None, "seed": 0, "full_determinism": False, **options}
        groups.append(WorkerGroup(role, 1, model_path, in_process=True, **options))
        return groups[-1]

    yield make
    for group in groups:
        group.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    """A `make_tiny` policy (Qwen2 layout, vocab 128) in a session temp dir."""
    from reprorl.models.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-policy"), kind="policy", seed=0)


@pytest.fixture(scope="session")
def assets(tmp_path_factory, tiny_policy_dir):
    """What the small end-to-end runs (tests/small_run.py) train on: arithmetic data (64 train,
    8 validation rows), the tiny policy and a tiny reward model. Read-only: runs write elsewhere."""
    from reprorl.data.synthetic import write_arithmetic_dataset
    from reprorl.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("assets")
    paths = write_arithmetic_dataset(root / "data", num_train=64, num_val=8, seed=0)
    return {"train": paths["train"], "val": paths["val"], "policy": tiny_policy_dir,
            "reward": make_tiny(root / "reward", kind="reward", seed=1)}


@pytest.fixture(scope="session")
def three_step_run(assets, tmp_path_factory):
    """The run directory of a plain 3-step small run (tests/small_run.py), trained once a
    session: the uninterrupted run that reruns, resumed runs and other seeds compare with,
    and whose checkpoints (one a step) the export tests read. It has 2 rollout replicas, the
    runs compared with it one (small_run's default): so each of those comparisons spans two
    replica counts too. It has the KL loss and its reference group (`WITH_KL`), as the runs
    compared with it must."""
    from reprorl.config import load_config
    from small_run import WITH_KL, run_trainer, small_run_overrides

    run_dir = tmp_path_factory.mktemp("three-step-run") / "run"
    run_trainer(load_config(None, small_run_overrides(assets, run_dir, *WITH_KL, "trainer.total_steps=3",
                                                      "rollout.num_replicas=2", "trainer.save_freq=1")))
    return run_dir


@pytest.fixture
def assert_bitwise_identical(capsys):
    """`assert_bitwise_identical(run_a, run_b, steps)`: `reprorl compare` exits 0 and prints
    "bitwise identical over `steps` steps" (its plot goes beside run_b)."""
    from reprorl import cli

    def check(run_a, run_b, steps: int) -> None:
        capsys.readouterr()
        code = cli.main(["compare", str(run_a), str(run_b), "--plot", str(run_b.parent / f"{run_b.name}.compare.png")])
        out = capsys.readouterr().out
        assert code == 0, out
        assert f"bitwise identical over {steps} steps" in out, out

    return check


def _rollout_batch(batch_size: int, prompt_len: int, response_len: int, seed: int, vocab: int = 128) -> Batch:
    """A batch shaped as the rollout hands it over: left-padded prompts, right-padded
    responses of random lengths (pad id 0), masks and position ids; random advantages."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.zeros(batch_size, prompt_len, dtype=torch.long)
    responses = torch.zeros(batch_size, response_len, dtype=torch.long)
    prompt_mask = torch.zeros(batch_size, prompt_len, dtype=torch.long)
    response_mask = torch.zeros(batch_size, response_len, dtype=torch.long)
    for b in range(batch_size):
        p = int(torch.randint(1, prompt_len + 1, (1,), generator=g))
        r = int(torch.randint(1, response_len + 1, (1,), generator=g))
        prompts[b, prompt_len - p:] = torch.randint(3, vocab, (p,), generator=g)
        prompt_mask[b, prompt_len - p:] = 1
        responses[b, :r] = torch.randint(3, vocab, (r,), generator=g)
        response_mask[b, :r] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    advantages = torch.randn(batch_size, response_len, generator=g) * response_mask
    return Batch({
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "advantages": advantages,
    })


@pytest.fixture
def rollout_batch():
    """`rollout_batch(batch_size, prompt_len, response_len, seed) -> Batch`."""
    return _rollout_batch


def _assert_grads_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Gradients of one loss summed in another grouping (micro-batches vs one pass), float32:
    they differ by rounding only, so every entry within 1e-5 of the tensor's largest entry
    (float32 eps is 1.2e-7; sums of up to a few hundred terms)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale)


@pytest.fixture
def assert_grads_close():
    return _assert_grads_close
