"""Lesson 05's exercises: ZeRO-Offload's one-step delayed parameter update (a case the lesson does not run)
and the bytes of an offloaded step under accumulation with optimizers the lesson does not offload. Each:
the solution passes, the wrong algorithms named below fail with a message naming the mistake, the lab's
and torch's offloading helpers are switched off, and an answer table logged in one grade run fails the next."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from solution_code import edit, run_check, table_cheat_fails


def test_the_solutions_pass(capsys):
    run_check("05", "check_delayed_offloaded_step")
    run_check("05", "check_offload_bytes")
    out = capsys.readouterr().out
    assert "check_delayed_offloaded_step passed" in out and "check_offload_bytes passed" in out


DPU = "delayed_offloaded_step"
NO_DELAY = edit("05", DPU, "    if not delayed:\n", "    if True:\n")  # an ordinary offloaded step every call
UPLOAD_ANYWAY = edit(
    "05", DPU, "    if use is not None:\n", "    if use is None:\n        for p, m in zip(params, masters):\n"
    "            p.data.copy_(to_device(m.detach().to(p.dtype)))\n    if use is not None:\n"
)  # fmt: skip
BOTH = edit(
    "05",
    DPU,
    "use = pending[:] if pending else None",
    "use = [a + b for a, b in zip(pending, arrived)] if pending else arrived",
)
STALE = edit(
    "05",
    DPU,
    "        pending[:] = arrived  # this step's wait",
    "        pending.extend([] if pending else arrived)  # this step's wait",
)
FP32_DOWN = edit(
    "05",
    DPU,
    "arrived = [to_host(p.grad).float() for p in params]",
    "arrived = [to_host(p.grad.float()) for p in params]",
)
TWO_LATE = edit(
    "05",
    DPU,
    "        use = pending[:] if pending else None",
    "        use = pending.pop(0) if len(pending) > 1 else None",
).replace(
    "        pending[:] = arrived  # this step's wait", "        pending.append(arrived)  # this step's wait"
)


@pytest.mark.parametrize(
    "wrong, match",
    [
        (NO_DELAY, "master 0 differs from the reference"),  # the delay ignored
        (UPLOAD_ANYWAY, "bytes went to the device, expected 0"),  # weights sent up that did not change
        (BOTH, "master 0 differs from the reference"),  # the pending and the new gradients applied together
        (STALE, "master 0 differs from the reference"),  # the first delayed gradients applied forever
        (FP32_DOWN, "bytes went to the host"),  # cast to fp32 on the device: 4 bytes per parameter down
        (TWO_LATE, "master 0 differs from the reference"),  # a delay of two steps
    ],
    ids=[
        "no-delay",
        "uploads-unchanged-weights",
        "applies-both",
        "never-replaces-pending",
        "fp32-down",
        "two-late",
    ],
)
def test_wrong_delayed_steps_fail(wrong, match):
    with pytest.raises(AssertionError, match=match):
        run_check("05", "check_delayed_offloaded_step", wrong)


BYTES = "offload_bytes"


@pytest.mark.parametrize(
    "wrong, match",
    [
        # gradients sent once per optimizer step, as if the device accumulated them
        (edit("05", BYTES, '"d2h": 2 * S * micro_batches', '"d2h": 2 * S'), "bytes sent to the host"),
        # every optimizer taken for Adam (the lesson's)
        (edit("05", BYTES, '"host": 4 * S * (2 + states)', '"host": 16 * S'), "bytes kept on the host"),
        # no fp32 gradient slice on the host
        (
            edit("05", BYTES, '"host": 4 * S * (2 + states)', '"host": 4 * S * (1 + states)'),
            "bytes kept on the host",
        ),
        # the slice without its padding
        (edit("05", BYTES, "S = -(-numel // world_size)", "S = numel // world_size"), "measured"),
        # weights sent back once per micro-batch
        (edit("05", BYTES, '"h2d": 2 * S', '"h2d": 2 * S * micro_batches'), "sent back to the device"),
    ],
    ids=["d2h-once-per-step", "adam-for-all", "no-grad-slice", "no-padding", "h2d-per-micro-batch"],
)
def test_wrong_byte_predictions_fail(wrong, match):
    # a wrong rule may agree with the truth on one drawn case: a few grade runs must expose it
    for _ in range(4):
        try:
            run_check("05", "check_offload_bytes", wrong)
        except AssertionError as e:
            assert re.search(match, str(e)), e
            return
    pytest.fail("four grade runs in a row accepted a wrong rule")


@pytest.mark.parametrize(
    "cheat, check",
    [
        ("from parallel_lab.offload import ZeroOffload\n"
         "def delayed_offloaded_step(params, masters, optimizer, to_host, to_device, pending, delayed):\n"
         "    ZeroOffload.step(None)\n", "check_delayed_offloaded_step"),
        ("from parallel_lab.offload import offload_state_bytes\n"
         "def offload_bytes(numel, world_size, micro_batches, optimizer):\n"
         "    offload_state_bytes(numel, world_size)\n", "check_offload_bytes"),
        ("from parallel_lab.costmodel import bytes_per_param\n"
         "def offload_bytes(numel, world_size, micro_batches, optimizer):\n"
         "    bytes_per_param(optimizer)\n", "check_offload_bytes"),
        ("from torch.distributed.fsdp._runtime_utils import _offload_grad\n"
         "def delayed_offloaded_step(params, masters, optimizer, to_host, to_device, pending, delayed):\n"
         "    _offload_grad(None, None)\n", "check_delayed_offloaded_step"),
    ],
    ids=["lab-zero-offload", "lab-offload-bytes", "lab-cost-model", "torch-fsdp-offload-grad"],
)  # fmt: skip
def test_wrappers_of_the_labs_and_torchs_helpers_are_switched_off(cheat, check):
    with pytest.raises(AssertionError, match="switched off"):
        run_check("05", check, cheat)


def test_a_table_of_one_runs_offload_bytes_fails_the_next():
    zero = dict.fromkeys(("d2h", "h2d", "host"), 0)
    # micro-batches, optimizers and the 3-rank model's size are drawn: a miss within three runs is near certain
    table_cheat_fails("05", BYTES, "check_offload_bytes", zero, "you predict 0 bytes", tries=3)


def test_a_table_of_one_runs_delayed_weights_fails_the_next():
    """A learner who logs the masters after each call in one run and writes them back in the next fails:
    sizes, weights and gradients are drawn per run (the table is keyed by call order)."""
    from solution_code import _check_cell, solution_namespace

    ns = solution_namespace("05")
    real, log = ns[DPU], []

    def logging(params, masters, optimizer, to_host, to_device, pending, delayed):
        real(params, masters, optimizer, to_host, to_device, pending, delayed)
        log.append([m.detach().clone() for m in masters])

    cell = compile(_check_cell("05", "check_delayed_offloaded_step"), "<check>", "exec")
    ns[DPU] = logging
    exec(cell, ns)  # noqa: S102
    calls = iter(log)

    def replay(params, masters, optimizer, to_host, to_device, pending, delayed):
        for m, old in zip(masters, next(calls)):
            if m.shape == old.shape:
                m.data.copy_(old)

    ns[DPU] = replay  # it moves no bytes either: whichever the check compares first fails
    with pytest.raises(AssertionError, match="differs|bytes went to the host"):
        exec(cell, ns)  # noqa: S102


# torch's functions with "offload" in their name, and why each that is not switched off does another job
OTHER_JOBS = {
    "torch._functorch._activation_offloading": "activation offloading (lesson 07's subject), not the optimizer's",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper": "activation offloading in a checkpoint wrapper",
    "torch.distributed.checkpoint._state_dict_stager": "copies a checkpoint's tensors for saving",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group": "validates FSDP2's offload options",
    "torch.distributed.fsdp._fully_shard._fsdp_api": "FSDP2's offload policy: configuration, no step",
    "torch.distributed.fsdp.api": "FSDP1's CPUOffload: configuration, no step",
    "torch.testing._internal.common_fsdp": "torch's own tests",
}


def test_torchs_offloading_helpers_are_switched_off_or_do_another_job():
    import torch

    from parallel_lab.grading.checks.offload import FORBIDDEN

    root = Path(torch.__file__).parent
    job = re.compile(r"^\s*(?:def|class) (\w*[Oo]ffload\w*)", re.M)
    found = {}
    for f in root.rglob("*.py"):
        text = f.read_text(encoding="utf-8", errors="ignore")
        names = job.findall(text)
        if names:
            module = ".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
            found[module] = names
    assert "torch.distributed.fsdp._runtime_utils" in found, (
        "the search finds nothing: torch's layout changed"
    )
    loose = {
        m: [n for n in names if f"{m}.{n}" not in FORBIDDEN]
        for m, names in found.items()
        if not any(m.startswith(k) for k in OTHER_JOBS)
    }
    loose = {m: n for m, n in loose.items() if n}
    assert not loose, f"torch functions that offload gradients or optimizer state, not switched off: {loose}"


def test_state_kept_outside_pending_fails():
    """Two runs are called in turn: gradients kept in a module-level list instead of each run's `pending`
    reach the wrong run."""
    cheat = (
        "_kept = []\n"
        "def delayed_offloaded_step(params, masters, optimizer, to_host, to_device, pending, delayed):\n"
        "    arrived = [to_host(p.grad).float() for p in params]\n"
        "    for p in params:\n        p.grad = None\n"
        "    if not delayed:\n        _kept.clear()\n        use = arrived\n"
        "    else:\n        use = _kept[:] if _kept else None\n        _kept[:] = arrived\n"
        "    if use is not None:\n"
        "        for m, g in zip(masters, use):\n            m.grad = g\n"
        "        optimizer.step()\n"
        "        for p, m in zip(params, masters):\n"
        "            p.data.copy_(to_device(m.detach().to(p.dtype)))\n            m.grad = None\n"
    )
    with pytest.raises(AssertionError, match="differs|raised|bytes"):
        run_check("05", "check_delayed_offloaded_step", cheat)
