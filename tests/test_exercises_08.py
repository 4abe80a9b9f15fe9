"""Lesson 08's exercises: the reference solution passes with one line; wrappers of the lab's and torch's
versions, collectives that bypass the lab's trace, answer tables from an earlier grade run and wrong
algorithms fail, each with a message naming what differed."""

from __future__ import annotations

import hashlib
import pickle
import re
from pathlib import Path

import pytest
import torch
from solution_code import _check_cell, edit, fails_saying, run_check, solution_namespace, table_cheat_fails

LOSS, EMB, BYTES = "VocabParallelCrossEntropy", "VocabParallelEmbedding", "vocab_step_bytes"
HEAD = "import torch\nimport torch.nn.functional as F\nfrom parallel_lab import comms\n"


def _loss(old: str, new: str, *more: tuple[str, str]) -> str:
    src = edit("08", LOSS, old, new)
    for a, b in more:
        assert a in src, a
        src = src.replace(a, b, 1)
    return src


def _back(old: str, new: str) -> str:
    return edit("08", "loss_backward", old, new)


def _emb(old: str, new: str) -> str:
    return edit("08", EMB, old, new)


# Every rank's x (rows, w_r) side by side, gathered by torch's dispatcher op rather than the lab's (untraced):
# the widths first, then the columns padded to the widest
GATHER = """
def gather_columns(x, p):
    if p == 1:
        return x
    fc, name = torch.ops._c10d_functional, torch.distributed.group.WORLD.group_name
    w = fc.wait_tensor(fc.all_gather_into_tensor(torch.tensor([x.shape[1]], device=x.device), p, name)).tolist()
    pad = x.new_zeros(max(w), x.shape[0])
    pad[: x.shape[1]] = x.t()
    every = fc.wait_tensor(fc.all_gather_into_tensor(pad.contiguous(), p, name))  # (p * max(w), rows)
    return torch.cat([every[k * max(w) : k * max(w) + w[k]] for k in range(p)]).t()
"""


def _fn(name: str, body: str, *args: str) -> str:
    """A learner's Function whose forward is `body` (its backward passes the gradient through)."""
    return (
        HEAD + f"class {name}(torch.autograd.Function):\n    @staticmethod\n"
        f"    def forward(fctx, {', '.join(args)}, ctx, group=None):\n" + body + "\n"
        "    @staticmethod\n    def backward(fctx, g):\n        return (None,) * 5\n"
    )


WRONG = [
    # ---- exercises 1 and 2: the loss over a split vocabulary
    ("check_vocab_parallel_loss", "no max subtraction (overflow)",
     _loss("z = logits - m[:, None]", "z = logits"), "exp overflows float64"),
    ("check_vocab_parallel_loss", "each rank's own max, not all-reduced",
     _loss('comms.dist_all_reduce(ctx, m, op="max", group=group)', "pass"), "maximum of its own shard"),
    ("check_vocab_parallel_loss", "an extra collective in forward",
     _loss("comms.dist_all_reduce(ctx, total, group=group)",
           "comms.dist_all_reduce(ctx, total, group=group)\n        comms.dist_all_gather(ctx, total, group=group)"),
     "forward should send a max all-reduce of"),
    ("check_vocab_parallel_loss", "a fourth all-reduce of N in forward",
     _loss("comms.dist_all_reduce(ctx, total, group=group)",
           "comms.dist_all_reduce(ctx, total, group=group)\n        comms.dist_all_reduce(ctx, logits.new_zeros(logits.shape[0], 1))"),
     "then sum all-reduces of"),
    ("check_vocab_parallel_loss_grad", "gradient without the onehot",
     _back("grad[rows, safe[rows]] -= 1.0", "pass"), "the target's term is missing"),
    ("check_vocab_parallel_loss_grad", "onehot at the global index on every rank",
     _loss("fctx.save_for_backward(", "fctx.target = target\n        fctx.save_for_backward(") + "\n"
     + _back("rows = here.nonzero()[:, 0]\n    grad[rows, safe[rows]] -= 1.0",
             "target = fctx.target\n    rows = (target < grad.shape[-1]).nonzero()[:, 0]\n"
             "    grad[rows, target[rows]] -= 1.0"),
     "this rank's column j is vocabulary entry"),
    ("check_vocab_parallel_loss_grad", "ignores grad_out",
     _back("return grad * grad_out[:, None], None", "return grad, None"), "ignores grad_output"),
    ("check_vocab_parallel_loss_grad", "an all-reduce in backward",
     _loss("fctx.save_for_backward(", "fctx.ctx, fctx.group = ctx, group\n        fctx.save_for_backward(") + "\n"
     + _back("soft, safe, here = fctx.saved_tensors",
             "soft, safe, here = fctx.saved_tensors\n    comms.dist_all_reduce(fctx.ctx, grad_out.clone(), group=fctx.group)"),
     "backward sent all_reduce of"),
    # ---- exercise 3: the embedding over a split vocabulary
    ("check_vocab_parallel_embedding", "no masking (a foreign id indexes the shard)",
     _emb("local = local.masked_fill(foreign, 0)", "pass"), "an id this rank does not hold has no row"),
    ("check_vocab_parallel_embedding", "masked rows not zeroed",
     _emb("out = F.embedding(local, weight).masked_fill(foreign[..., None], 0.0)", "out = F.embedding(local, weight)"),
     "got that rank's row 0 added"),
    ("check_vocab_parallel_embedding", "the gradient to clamped row 0",
     _emb("g = grad_out.masked_fill(foreign[..., None], 0.0).reshape(", "g = grad_out.reshape("),
     "row 0 of this rank's shard got the gradients"),
    ("check_vocab_parallel_embedding", "repeated ids overwrite, not add",
     _emb("grad_w.index_add_(0, local.reshape(-1), g)",
          "keep = ~foreign.reshape(-1)\n        grad_w[local.reshape(-1)[keep]] = g[keep]"),
     "is not the sum over its tokens"),
    ("check_vocab_parallel_embedding", "an all-reduce in backward",
     _emb("local, foreign = fctx.saved_tensors",
          "local, foreign = fctx.saved_tensors\n        comms.dist_all_reduce(fctx.ctx, grad_out.clone())")
     .replace("fctx.rows = weight.shape[0]", "fctx.rows, fctx.ctx = weight.shape[0], ctx"),
     "backward sent all_reduce of"),
    # ---- exercise 4: predict the bytes of the sequence-parallel embedding and the fused loss
    ("check_vocab_step_bytes", "no sequence parallelism: the embedding's all-reduce (rings cut by elements)",
     edit("08", BYTES, "(scatter + gather + ring(n)", "(ring(n * h) + ring(n)"), "you predict"),
    ("check_vocab_step_bytes", "the reduce-scatter's backward sends nothing",
     edit("08", BYTES, "(scatter + gather + ring(n)", "(scatter + ring(n)"), "in backward"),
    ("check_vocab_step_bytes", "the backward all-gather skips this rank's own block, not its neighbour's",
     edit("08", BYTES, "(n - tokens[(rank + 1) % p]) * h", "(n - tokens[rank]) * h"), "you predict"),
    ("check_vocab_step_bytes", "the loss as three rings of N, not a ring of N and one of 2N",
     edit("08", BYTES, "ring(n) + ring(2 * n)", "3 * ring(n)"), "you predict"),
    ("check_vocab_step_bytes", "elements, not bytes",
     edit("08", BYTES, "ring(2 * n)) * itemsize", "ring(2 * n))"), "you predict"),
    ("check_vocab_step_bytes", "the even-chunk formula, rounded",
     edit("08", BYTES, "c = comms.chunk_sizes(m, p)\n        return 2 * m - c[rank] - c[(rank + 1) % p]",
          "return round(2 * (p - 1) * m / p)"), "you predict"),
    ("check_vocab_step_bytes", "the logits travel (vocab-dependent)",
     edit("08", BYTES, "ring(n) + ring(2 * n)", "ring(n) + ring(2 * n) + ring(n * vocab)"), "you predict"),
]  # fmt: skip

# The lab's and torch's versions of the job, the check's own reference, and collectives that bypass the trace
CHEATS = [
    ("check_vocab_parallel_loss", "the check's own reference loss",
     HEAD + "from parallel_lab.grading.checks.tensor_parallel import _RefLoss\n"
     "class VocabParallelCrossEntropy(torch.autograd.Function):\n"
     "    apply = staticmethod(lambda logits, target, start, ctx, group=None: _RefLoss.apply(logits, target, start, ctx))\n"),
    ("check_vocab_parallel_loss", "torch's loss_parallel (public)",
     _fn(LOSS, "        from torch.distributed.tensor.parallel import loss_parallel\n"
               "        with loss_parallel():\n            return F.cross_entropy(logits, target, reduction='none')\n",
         "logits", "target", "vocab_start")),
    ("check_vocab_parallel_loss", "torch's private vocab-parallel nll",
     _fn(LOSS, "        from torch.distributed.tensor.parallel.loss import _nll_loss_forward\n"
               "        return _nll_loss_forward(logits, target, None, 0, -100, None, 0)[0]\n",
         "logits", "target", "vocab_start")),
    ("check_vocab_parallel_loss", "torch's private log-softmax over a mesh",
     _fn(LOSS, "        from torch.distributed.tensor.parallel.loss import _log_softmax\n"
               "        return -_log_softmax(logits, -1, False, None, 0)[:, 0]\n", "logits", "target", "vocab_start")),
    ("check_vocab_parallel_loss", "torch.distributed.all_reduce called directly (untraced)",
     _loss('comms.dist_all_reduce(ctx, m, op="max", group=group)',
           "torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX)")),
    ("check_vocab_parallel_loss", "the process group's allreduce called directly",
     _loss('comms.dist_all_reduce(ctx, m, op="max", group=group)',
           "torch.distributed.distributed_c10d._get_default_group().allreduce([m]).wait()")),
    ("check_vocab_parallel_loss", "torch's functional all-reduce",
     _loss("comms.dist_all_reduce(ctx, picked, group=group)",
           "import torch.distributed._functional_collectives as fc\n"
           "        picked = fc.all_reduce(picked, 'sum', torch.distributed.group.WORLD)")),
    ("check_vocab_parallel_loss", "the logits gathered through torch.ops._c10d_functional, three dummy all-reduces",
     GATHER + _fn(LOSS, "        whole = gather_columns(logits, ctx.world_size)\n"
                        "        for _ in range(3):\n"
                        "            comms.dist_all_reduce(ctx, logits.new_zeros(len(target)), group=group)\n"
                        "        return F.cross_entropy(whole, target, reduction='none')\n",
                  "logits", "target", "vocab_start")),
    ("check_vocab_parallel_loss", "the dispatcher's c10d::allreduce_ called directly",
     _loss('comms.dist_all_reduce(ctx, m, op="max", group=group)',
           "pg = torch.distributed.distributed_c10d._get_default_group()\n"
           "        torch.ops.c10d.allreduce_([m], pg.boxed(), torch.classes.c10d.ReduceOp(), None, False, -1)[1].wait()")),
    ("check_vocab_parallel_loss", "the backend's allreduce (pg._get_backend), which skips the dispatcher",
     _loss('comms.dist_all_reduce(ctx, m, op="max", group=group)',
           "pg = torch.distributed.distributed_c10d._get_default_group()\n"
           "        opts = torch.distributed.AllreduceOptions()\n"
           "        opts.reduceOp = torch.distributed.ReduceOp.MAX\n"
           "        pg._get_backend(m.device).allreduce([m], opts).wait()")),
    ("check_vocab_parallel_loss", "torch.distributed.all_reduce from exec'd code named torch.x",
     _loss('comms.dist_all_reduce(ctx, m, op="max", group=group)',
           "exec('dist.all_reduce(m, op=dist.ReduceOp.MAX)', {'__name__': 'torch.x', 'dist': torch.distributed, 'm': m})")),
    ("check_vocab_parallel_loss", "torch.distributed.all_reduce compiled under a comms file name",
     _loss('comms.dist_all_reduce(ctx, m, op="max", group=group)',
           "exec(compile('dist.all_reduce(m, op=dist.ReduceOp.MAX)', comms.core.__file__, 'exec'),\n"
           "             {'__name__': 'parallel_lab.comms.core', 'dist': torch.distributed, 'm': m})")),
    ("check_vocab_parallel_embedding", "the whole table gathered through torch.ops._c10d_functional",
     GATHER + HEAD + "class VocabParallelEmbedding(torch.autograd.Function):\n"
     "    @staticmethod\n    def forward(fctx, ids, weight, vocab_start, ctx, group=None):\n"
     "        whole = gather_columns(weight.t(), ctx.world_size).t()\n"
     "        comms.dist_all_reduce(ctx, weight.new_zeros(*ids.shape, weight.shape[1]), group=group)\n"
     "        fctx.save_for_backward(ids - vocab_start)\n        fctx.rows = weight.shape[0]\n"
     "        return F.embedding(ids, whole)\n"
     "    @staticmethod\n    def backward(fctx, g):\n        (local,) = fctx.saved_tensors\n"
     "        mine = (local >= 0) & (local < fctx.rows)\n"
     "        gw = g.new_zeros(fctx.rows, g.shape[-1]).index_add_(0, local[mine], g[mine])\n"
     "        return None, gw, None, None, None\n"),
    ("check_vocab_parallel_embedding", "the lab's g operator",
     _emb("comms.dist_all_reduce(ctx, out, group=group)",
          "from parallel_lab.tensor_parallel import reduce_from_tp_region\n"
          "        out = reduce_from_tp_region(ctx, out, group)")),
    ("check_vocab_parallel_embedding", "the lab's TP all-reduce helper",
     _emb("comms.dist_all_reduce(ctx, out, group=group)",
          "from parallel_lab.tensor_parallel import all_reduce\n        all_reduce(ctx, out, group)")),
    ("check_vocab_parallel_embedding", "the check's own reference embedding",
     HEAD + "from parallel_lab.grading.checks.tensor_parallel import _RefEmbedding\n"
     "class VocabParallelEmbedding(torch.autograd.Function):\n"
     "    apply = staticmethod(lambda ids, w, start, ctx, group=None: _RefEmbedding.apply(ids, w, start, ctx))\n"),
    ("check_vocab_parallel_embedding", "torch's RowwiseParallel embedding (public)",
     _fn(EMB, "        from torch.distributed.tensor.parallel import RowwiseParallel\n"
              "        RowwiseParallel()._partition_embedding_fn('emb', torch.nn.Embedding(2, 2), None)\n",
         "ids", "weight", "vocab_start")),
    ("check_vocab_parallel_embedding", "torch's parallelize_module (public)",
     _fn(EMB, "        from torch.distributed.tensor.parallel import parallelize_module, RowwiseParallel\n"
              "        parallelize_module(torch.nn.Embedding(2, 2), None, RowwiseParallel())\n",
         "ids", "weight", "vocab_start")),
    ("check_vocab_parallel_embedding", "torch's private _MaskPartial",
     _fn(EMB, "        from torch.distributed.tensor.placement_types import _MaskPartial\n"
              "        _MaskPartial(offset_shape=torch.Size([9, weight.shape[1]]), offset_dim=0)\n",
         "ids", "weight", "vocab_start")),
    ("check_vocab_parallel_embedding", "torch's private sharded-tensor row-wise lookup",
     _fn(EMB, "        from torch.distributed._shard.sharding_spec.chunk_sharding_spec_ops import _common\n"
              "        _common._handle_row_wise_mask(ids, 0, weight.shape[0], vocab_start, 'cpu')\n",
         "ids", "weight", "vocab_start")),
    ("check_vocab_step_bytes", "the lab's ring byte formula",
     "from parallel_lab.comms import ring_bytes_per_rank as rb\ndef vocab_step_bytes(n, h, vocab, p, rank, itemsize):\n"
     "    return rb(n * h, p, itemsize, 'all_reduce')[rank] + 3 * rb(n, p, itemsize, 'all_reduce')[rank]\n"),
    ("check_vocab_step_bytes", "the check's own measurement",
     "from parallel_lab.grading.checks.tensor_parallel import _measure_step\n"
     "def vocab_step_bytes(n, h, vocab, p, rank, itemsize):\n    return _measure_step(None, [])\n"),
]  # fmt: skip

CHECKS = ["check_vocab_parallel_loss", "check_vocab_parallel_loss_grad", "check_vocab_parallel_embedding",
          "check_vocab_step_bytes"]  # fmt: skip


@pytest.mark.parametrize("check", CHECKS)
def test_the_solution_passes_with_one_line(check, capsys):
    run_check("08", check)
    out, err = capsys.readouterr()
    lines = [ln for ln in out.splitlines() if ln.startswith("check_")]
    assert len(lines) == 1 and lines[0].startswith(f"{check} passed"), out
    assert not re.search(r"\d\.\d{3}", lines[0]), "a drawn number in the success line"


@pytest.mark.parametrize(("check", "label", "source", "want"), WRONG, ids=[w[1] for w in WRONG])
def test_a_wrong_answer_fails_saying_what_differed(check, label, source, want):
    fails_saying("08", check, label, source, want)


@pytest.mark.parametrize(("check", "label", "source"), CHEATS, ids=[c[1] for c in CHEATS])
def test_the_labs_and_torchs_versions_are_switched_off(check, label, source):
    with pytest.raises(AssertionError, match="switched off"):
        run_check("08", check, source)


# Megatron-core's fused forward (megatron/core/fusions/fused_cross_entropy.py): the max, then the target's logits and
# the exps' sums side by side in one all-reduce of 2N
FUSED = _loss(
    "picked = torch.where(here, z.gather(1, safe[:, None])[:, 0], torch.zeros_like(m))  # (N,)\n"
    "        comms.dist_all_reduce(ctx, picked, group=group)",
    "picked = torch.where(here, z.gather(1, safe[:, None])[:, 0], torch.zeros_like(m))  # (N,)",
    (
        "comms.dist_all_reduce(ctx, total, group=group)",
        "both = comms.dist_all_reduce(ctx, torch.cat((picked, total)), group=group)\n"
        "        picked, total = both.split(len(m))",
    ),
)


@pytest.mark.parametrize("check", ["check_vocab_parallel_loss", "check_vocab_parallel_loss_grad"])
def test_the_fused_forward_passes_too(check, capsys):
    run_check("08", check, FUSED)
    assert capsys.readouterr().out.startswith(f"{check} passed")


def test_the_dispatcher_cheat_passes_when_nothing_guards_the_collectives(monkeypatch, capsys):
    """The gather through torch.ops._c10d_functional is a real cheat: with the guard taken away it passes, so
    only the guard makes it fail above."""
    import contextlib

    from parallel_lab.grading.checks import tensor_parallel

    monkeypatch.setattr(tensor_parallel, "_only_traced", lambda what: contextlib.nullcontext())
    source = next(c[2] for c in CHEATS if "torch.ops._c10d_functional, three" in c[1])
    run_check("08", "check_vocab_parallel_loss", source)
    assert capsys.readouterr().out.startswith("check_vocab_parallel_loss passed")


def test_an_unfinished_exercise_stays_not_implemented_and_a_non_function_is_named():
    from parallel_lab.grading import check_vocab_parallel_embedding, check_vocab_parallel_loss

    todo = _fn(LOSS, "        raise NotImplementedError('exercise 1')\n", "logits", "target", "vocab_start")
    with pytest.raises(NotImplementedError):
        run_check("08", "check_vocab_parallel_loss", todo)
    with pytest.raises(TypeError, match="apply"):
        check_vocab_parallel_loss(lambda x: x)
    with pytest.raises(TypeError, match="apply"):
        check_vocab_parallel_embedding(object())


# ----------------------------------------------------------------------------- cases drawn at grade time
def _key(*tensors: torch.Tensor, extra=()) -> str:
    h = hashlib.sha256(repr(extra).encode())
    for t in tensors:
        h.update(t.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:32]


def _table_run(check: str, name: str, make) -> None:
    """Log one grade run's answers (the ranks are processes: the table goes to files), then answer the
    next run from that table; the next run's drawn cases are not in it."""
    ns = solution_namespace("08")
    cell = compile(_check_cell("08", check), f"<check cell {check}>", "exec")
    logging, from_table, book = make(ns[name])
    ns[name] = logging
    exec(cell, ns)  # noqa: S102
    assert len(list(book.iterdir())) > 20
    ns[name] = from_table
    with pytest.raises(AssertionError, match="differs at"):
        exec(cell, ns)  # noqa: S102


def test_a_table_of_one_grade_runs_losses_fails_the_next(tmp_path):
    def make(real):
        class Logging(torch.autograd.Function):
            @staticmethod
            def forward(fctx, logits, target, vocab_start, ctx, group=None):
                loss = real.forward(fctx, logits, target, vocab_start, ctx, group)
                path = tmp_path / _key(logits, target, extra=(vocab_start, ctx.world_size))
                path.write_bytes(pickle.dumps(loss.cpu()))
                return loss

            backward = real.backward

        class FromTable(torch.autograd.Function):
            @staticmethod
            def forward(fctx, logits, target, vocab_start, ctx, group=None):
                path = tmp_path / _key(logits, target, extra=(vocab_start, ctx.world_size))
                return pickle.loads(path.read_bytes()) if path.exists() else logits.new_zeros(logits.shape[0])

            @staticmethod
            def backward(fctx, g):
                return (None,) * 5

        return Logging, FromTable, tmp_path

    _table_run("check_vocab_parallel_loss", LOSS, make)


def test_a_table_of_one_grade_runs_embeddings_fails_the_next(tmp_path):
    def make(real):
        class Logging(torch.autograd.Function):
            @staticmethod
            def forward(fctx, ids, weight, vocab_start, ctx, group=None):
                out = real.forward(fctx, ids, weight, vocab_start, ctx, group)
                path = tmp_path / _key(ids, weight, extra=(vocab_start, ctx.world_size))
                path.write_bytes(pickle.dumps(out.cpu()))
                return out

            backward = real.backward

        class FromTable(torch.autograd.Function):
            @staticmethod
            def forward(fctx, ids, weight, vocab_start, ctx, group=None):
                path = tmp_path / _key(ids, weight, extra=(vocab_start, ctx.world_size))
                if path.exists():
                    return pickle.loads(path.read_bytes())
                return weight.new_zeros(*ids.shape, weight.shape[1])

            @staticmethod
            def backward(fctx, g):
                return (None,) * 5

        return Logging, FromTable, tmp_path

    _table_run("check_vocab_parallel_embedding", EMB, make)


def test_a_table_of_one_grade_runs_byte_counts_fails_the_next():
    # 12 of 18 shapes a run asks about are drawn: a run that repeats every one is next to impossible
    table_cheat_fails("08", BYTES, "check_vocab_step_bytes", 0, "you predict 0 bytes")


# ----------------------------------------------------------------------------- torch's own versions
# Names of functions and classes that shard a loss or an embedding over the vocabulary, or propagate a
# sharding through them (DTensor's rules), in torch.distributed; and anything named vocab-parallel in torch
JOB = re.compile(
    r"^[ \t]*(?:class|def) (_?\w*(?:vocab|loss_parallel|cross_entropy|nll_loss|softmax|embedding|MaskPartial"
    r"|mask_partial|row_wise_mask|row_wise_sharding)\w*)",
    re.M | re.I,
)


def test_torchs_own_versions_of_an_exercise_are_switched_off():
    """torch's functions that do an exercise's job (found by name in torch's source) are all in the checks'
    switched-off list: a new torch that adds one fails here, not in a learner's notebook."""
    from parallel_lab.grading.checks import tensor_parallel

    root = Path(torch.__file__).parent
    off = tensor_parallel._forbidden()
    found: dict[str, list[str]] = {}
    for f in (root / "distributed").rglob("*.py"):
        text = f.read_text(encoding="utf-8", errors="ignore")
        module = ".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        for match in JOB.finditer(text):
            found.setdefault(module, []).append(match.group(1))
    assert "torch.distributed.tensor.parallel.loss" in found, (
        "the search finds nothing: torch's layout changed"
    )
    missing = {
        m: [n for n in names if not any(k.startswith(m + ".") and n in k.split(".") for k in off)]
        for m, names in found.items()
    }
    missing = {m: names for m, names in missing.items() if names}
    assert not missing, f"torch functions doing an exercise's job, not switched off: {missing}"
    elsewhere = [
        f for f in root.rglob("*.py") if re.search(r"vocab_?parallel", f.read_text(errors="ignore"), re.I)
    ]
    assert not elsewhere, f"torch has a vocabulary-parallel layer outside torch.distributed: {elsewhere}"
