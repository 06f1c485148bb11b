"""Training speed and memory of rnndrop's recurrent layers against nn.LSTM / nn.GRU.

    python benchmarks/speed.py                               # small and medium, LSTM and GRU
    python benchmarks/speed.py --shapes large --models lstm --rounds 5
    python benchmarks/speed.py --device cuda --shapes small,medium,large --batch 20,64,128 --json speed.json
    python benchmarks/speed.py --mode mc-eval                # Monte-Carlo prediction: forward only
    python benchmarks/speed.py --mode mc-predict --samples 20  # ... through rnndrop.mc, per sample
    python benchmarks/speed.py --device cuda --autocast bfloat16  # forward under AMP

Every variant runs forward + backward of ``out.sum()`` in training mode on the
Zaremba et al. (2014) shapes: batch 20 (``--batch``: one or more), 35 steps, 2 layers, input
size = hidden size (small 200, medium 650, large 1500), float32. Variants, for the LSTM and the GRU:

- ``nn.LSTM`` / ``nn.GRU``: no dropout, the baseline every ratio is taken against;
- ``<scope>/<kernel>``: ``VariationalLSTM/GRU`` with dropout_input, dropout (between
  layers), dropout_hidden and dropout_output all ``--p``, masks drawn afresh every call,
  ``mask_scope`` sequence (Gal & Ghahramani), step (fresh masks every step, the recurrent
  state's too), or ``gates``: sequence with
  ``per_gate_masks=True``; run by each loop kernel of ``rnndrop.kernels.KERNELS`` that runs on
  the device (``--kernels``; on CPU all but "triton", on CUDA all but "compiled"; ``*`` marks the
  one ``kernel="auto"`` runs here, also named in the header);
- ``sequence/triton-step``: the per-sequence masks on the Triton kernel's per-step loop, the
  persistent loop turned off (``rnndrop.kernels.persistent.turned_off``; CUDA), what ran before it;
- ``sequence/triton-step+graphs``: that per-step loop replayed from CUDA graphs
  (``rnndrop.kernels.cuda_graphs``, on for this variant only; CUDA);
- ``sequence/triton-resident``: the persistent loop with its ``W_hh`` tiles resident on chip
  (``persistent.tuning["resident"]``, on for this variant only; hidden 200; CUDA);
- ``sequence/triton-spread`` / ``sequence/triton-unspread``: the persistent loop with / without
  programs of fewer units than their tile on multiprocessors that would idle
  (``persistent.tuning["spread"]``, on / off for this variant only; by default on for the LSTM since
  the H200's sixth round, off for the GRU: ``persistent.SPREAD``; CUDA);
- ``sequence/triton-half``: the persistent loop whose forward reads the masked states from a float16
  copy (``persistent.tuning["half_state"]``, on for this variant only; CUDA);
- ``nn.LSTM+graph`` / ``nn.GRU+graph`` and ``sequence+graph``: the baseline and the per-sequence
  masks on the loop ``kernel="auto"`` runs, each whole layer's forward and backward replayed from
  CUDA graphs (``torch.cuda.make_graphed_callables``: what a user can do at fixed shapes; no host
  work is left in a step, so their ratio is the GPU's time alone; CUDA);
- ``nn.LSTM+compile`` / ``nn.GRU+compile``, ``sequence+compile``, ``gates+compile``,
  ``batch+compile`` and ``none/triton+compile`` (only when ``--variants`` names them: each compiles
  for a while): the baseline, the per-sequence, per-gate and batch-shared masks, and no dropout on
  the Triton loop (``kernel="triton"``; CUDA), each module under ``rnndrop.compile_model``
  (``torch.compile`` with ``allow_rnn``; ``mode="reduce-overhead"`` on CUDA: forward and backward
  replayed from CUDA graphs), so that the layer's masks and projections are in the graph and each
  recurrence one operator (``rnndrop.kernels.ops``; batch-shared masks run torch's fused op
  eagerly between graphs): what a user who compiles the model gets;
- ``batch/fused``: ``mask_scope="batch"``: the recurrent mask is shared by the batch and
  folded into ``W_hh``, so torch's fused kernel runs;
- ``naive/fused``: Zaremba's naive dropout (the ``naive`` regime of rnndrop-lm): per-step masks on
  the inputs, between layers and on the outputs, none on the recurrent state, so each layer runs
  alone through torch's fused kernel;
- ``weight_drop``: ``WeightDrop(nn.LSTM, every weight_hh, p)`` (DropConnect), when
  ``rnndrop.weight_drop`` is there.

``--mode mc-eval`` times what Monte-Carlo prediction runs instead: the forward pass alone under
``torch.no_grad()``, the dropout modules in training mode so that every call draws fresh masks,
against the baseline's forward under ``no_grad``; memory is not measured then. ``--mode
mc-predict`` times Monte-Carlo prediction as a user runs it: each variant's call draws ``--samples``
samples through ``rnndrop.mc.mc_predict`` (stacked into one forward of that many copies of the
batch where the masks are per sequence, a call a sample where a mask is shared by the batch) and
its time is divided by them, against one inference forward of the baseline: the time a sample of
uncertainty costs next to a point prediction.

``--autocast bfloat16`` (or ``float16``) runs every variant's forward, the baseline's too, under
``torch.autocast`` in that dtype and the backward outside it, as an AMP training loop does (the
loops' products then run in that dtype with a float32 state); the ``+graph`` and ``+compile``
variants are left out then.

Timing: warm-up calls, then interleaved rounds; every round runs the variants once each
in a fresh random order, so load from other processes hits all of them alike. A
variant's ratio is the median over rounds of its time over the baseline's time in the
same round; "±" is the interquartile range of its times over their median. "first" is
the first call's time (a cold compile would show there).

Memory: on CPU the bytes saved for backward (``torch.autograd.graph.saved_tensors_hooks``,
each storage counted once, parameters excluded); on CUDA the peak of
``torch.cuda.max_memory_allocated`` over forward + backward above what was allocated before.
What the CUDA graphs of ``sequence/triton-step+graphs`` and of the ``+graph`` variants hold between
calls is allocated before, so not in that peak: a line under the table gives it (for the first, the
memory their release returns; for the others, what building them allocated).

On CUDA the header names the GPU, its driver, CUDA, torch and Triton, and a last table sets the
ratios against issue 41's goals (:data:`GOALS`: the exact per-sequence masks on the Triton kernel
within 0.5x cuDNN at hidden 200 and 650 and 1.0x at 1500, per-step and per-gate masks within 10%
of them, batch-shared masks and WeightDrop within 1.05x, peak memory no more than cuDNN's).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.metadata
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from rnndrop import VariationalGRU, VariationalLSTM, compile_model
from rnndrop.atomic import unwritable, write_json_atomic
from rnndrop.kernels import KERNELS, auto_loop_kernel, cuda_graphs, get_kernel
from rnndrop.kernels.onednn import onednn_enabled
from rnndrop.kernels.precision import cudnn_rnn_tf32, matmul_precision
from rnndrop.lm.run.train import resolve_device
from rnndrop.mc import mc_predict
from rnndrop.weight_drop import WeightDrop

SHAPES = {"small": 200, "medium": 650, "large": 1500}



def build_variants(
    model: str, hidden: int, layers: int, p: float, kernels: list[str], auto: str = "",
    compiled: bool = False,
) -> dict[str, nn.Module]:
    """The modules to time, baseline first (``auto``: the loop kernel ``kernel="auto"`` runs;
    ``compiled``: with the ``+compile`` variants)."""
    base_cls, ours_cls = (nn.LSTM, VariationalLSTM) if model == "lstm" else (nn.GRU, VariationalGRU)
    probs = dict(dropout=p, dropout_input=p, dropout_hidden=p, dropout_output=p)
    variants: dict[str, nn.Module] = {f"nn.{base_cls.__name__}": base_cls(hidden, hidden, layers)}
    for scope in ("sequence", "step", "gates"):
        per_gate = scope == "gates"
        masks = dict(mask_scope="sequence" if per_gate else scope, per_gate_masks=per_gate)
        for kernel in kernels:
            mark = "*" if kernel == auto else ""
            variants[f"{scope}/{kernel}{mark}"] = ours_cls(
                hidden, hidden, layers, kernel=kernel, **masks, **probs
            )
    if "triton" in kernels:
        variants[STEP_KERNEL] = ours_cls(hidden, hidden, layers, kernel="triton", **probs)
        variants[GRAPHED] = ours_cls(hidden, hidden, layers, kernel="triton", **probs)
        for name in TUNED:
            variants[name] = ours_cls(hidden, hidden, layers, kernel="triton", **probs)
        variants[f"nn.{base_cls.__name__}{WHOLE_GRAPH}"] = base_cls(hidden, hidden, layers)
        variants[f"sequence{WHOLE_GRAPH}"] = ours_cls(hidden, hidden, layers, **probs)
    if compiled:
        variants[f"nn.{base_cls.__name__}{COMPILED}"] = base_cls(hidden, hidden, layers)
        variants[f"sequence{COMPILED}"] = ours_cls(hidden, hidden, layers, **probs)
        variants[f"gates{COMPILED}"] = ours_cls(hidden, hidden, layers, per_gate_masks=True, **probs)
        variants[f"batch{COMPILED}"] = ours_cls(hidden, hidden, layers, mask_scope="batch", **probs)
        if "triton" in kernels:  # no dropout, the recurrence on the loop all the same (kernel="triton")
            variants[PLAIN_LOOP] = ours_cls(hidden, hidden, layers, kernel="triton")
    variants["batch/fused"] = ours_cls(hidden, hidden, layers, mask_scope="batch", **probs)
    # Zaremba's naive dropout: fresh masks every step between layers, none on the recurrent state
    # (each layer alone through the fused kernel)
    variants["naive/fused"] = ours_cls(hidden, hidden, layers, mask_scope="step", dropout=p, dropout_input=p,
                                       dropout_output=p)
    names = [f"weight_hh_l{k}" for k in range(layers)]
    variants["weight_drop"] = WeightDrop(base_cls(hidden, hidden, layers), names, p=p)
    return variants


#: The variant whose loops are replayed from CUDA graphs (the step kernel's: the persistent loop
#: is one launch already).
GRAPHED = "sequence/triton-step+graphs"
#: The per-sequence masks on the Triton kernel's per-step loop, the persistent loop turned off.
STEP_KERNEL = "sequence/triton-step"
#: The per-sequence masks on the persistent loop with resident ``W_hh`` tiles (hidden <= 256; off by
#: default until measured; elsewhere the same launches as ``sequence/triton``).
RESIDENT = "sequence/triton-resident"
#: The per-sequence masks on the persistent loop with / without programs of fewer units on
#: multiprocessors that would idle (``persistent.SPREAD``: the LSTM's default, not the GRU's).
SPREAD, UNSPREAD = "sequence/triton-spread", "sequence/triton-unspread"
#: The per-sequence masks on the persistent loop whose forward reads the masked states from a float16
#: copy (``persistent.HALF_STATE``; off by default until measured).
HALF = "sequence/triton-half"
#: The variants that run with a launch setting of ``persistent.tuning`` on, for them only.
TUNED = {RESIDENT: {"resident": True}, SPREAD: {"spread": True}, UNSPREAD: {"spread": False},
         HALF: {"half_state": True}}
#: No dropout, the recurrence on the persistent loop (``kernel="triton"``), under torch.compile: what
#: the LM regimes without a recurrent mask (``none``, ``naive``, zaremba's tied) would train at were
#: their recurrence run on the loop, compiled, instead of on cuDNN eagerly.
PLAIN_LOOP = "none/triton+compile"
#: The suffix of the variants whose whole layer (forward and backward) replays from CUDA graphs.
WHOLE_GRAPH = "+graph"
#: The suffix of the variants that run under torch.compile.
COMPILED = "+compile"


#: ``--autocast``'s dtypes.
AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class UnderAutocast(nn.Module):
    """``module`` whose forward runs under ``torch.autocast`` in ``dtype`` (``--autocast``); the
    backward runs outside it, as an AMP training loop runs it."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> tuple:
        with torch.autocast(x.device.type, dtype=self.dtype):
            return self.module(x)


def graph_whole_layer(module: nn.Module, x: torch.Tensor) -> int:
    """Make ``module``'s forward and backward replay from CUDA graphs captured on ``x``'s shape
    (``torch.cuda.make_graphed_callables``, in place); the bytes building them allocated."""
    torch.cuda.synchronize(x.device)
    before = torch.cuda.memory_allocated(x.device)
    torch.cuda.make_graphed_callables(module, (x,))
    torch.cuda.synchronize(x.device)
    return torch.cuda.memory_allocated(x.device) - before


def persistent_plan(x: torch.Tensor, batch: int, model: str = "lstm") -> str:
    """How the Triton kernel's persistent loop runs a layer of ``model`` (``"lstm"``, ``"gru"``) of
    this shape on CUDA (empty elsewhere): the programs per block of rows, the row blocks and the
    hidden units a program owns."""
    if x.device.type != "cuda":
        return ""
    from rnndrop.kernels import persistent

    hidden = x.shape[-1]
    gates = 4 if model == "lstm" else 3
    how = persistent.plan(x.new_empty(0, gates * hidden), hidden, batch, False, cell=model)
    if how is None:
        return "; persistent loop: no (the step kernel runs)"
    return (f"; persistent loop: {how.programs} x {how.row_blocks} programs of {how.units} units x "
            f"{-(-batch // how.row_blocks)} rows")


def fitted_pipelines(shown: set) -> str:
    """The K block and load pipeline depth each persistent launch kept (``persistent._stages``) that
    is not yet in ``shown`` (then added to it): where shared memory made a launch take a narrower K
    block or a shallower pipeline than planned (``persistent._fittings``), a GPU run says so here.
    Empty where no persistent loop ran."""
    if "rnndrop.kernels.persistent" not in sys.modules:  # (never imports Triton itself)
        return ""
    from rnndrop.kernels import persistent

    found = []
    for key, fit in list(persistent._stages.items()):
        if key in shown:
            continue
        shown.add(key)
        settings = dict(key[1])
        launch = (f"{key[0].strip('_')} (rows {settings.get('BB')}, "
                  f"mask gates {settings.get('MASK_GATES', 1)}, K {settings.get('BK')})")
        found.append(f"{launch}: " + ("nothing fits" if fit is None else f"K {fit[0]} x {fit[1]} stages"))
    return "; ".join(found)


_PIPELINES_SHOWN: set = set()


def train_step(module: nn.Module, x: torch.Tensor) -> None:
    out, _ = module(x)
    out.sum().backward()


def mc_eval_step(module: nn.Module, x: torch.Tensor) -> None:
    """One Monte-Carlo sample: the forward pass with fresh masks (training mode), no graph."""
    with torch.no_grad():
        module(x)


def mc_predict_step(module: nn.Module, x: torch.Tensor, samples: int) -> None:
    """``samples`` Monte-Carlo samples as a user draws them, through :func:`rnndrop.mc.mc_predict`
    (its ``method="auto"``): stacked into one forward call of ``samples`` copies of the batch, each
    copy with masks of its own (masks shared by a batch drawn per sequence then), except for masks
    shared by the batch off CUDA and for noise on weights (one call a sample), then summarised
    (mean and variance of the outputs)."""
    mc_predict(module, x, n_samples=samples, task="regression", batch_dim=1, chunk_size=samples)


#: What a call of each mode runs (``mc-predict``: the baseline's call; the variants run
#: :func:`mc_predict_step`).
STEPS = {"train": train_step, "mc-eval": mc_eval_step, "mc-predict": mc_eval_step}


@contextlib.contextmanager
def graphs_on(on: bool, max_graphs: int = 8):
    """CUDA graphs for the Triton loops while ``on`` (the graphs stay cached when it ends)."""
    before = cuda_graphs.GRAPHS.max_graphs
    cuda_graphs.GRAPHS.max_graphs = max_graphs if on else 0
    try:
        yield
    finally:
        cuda_graphs.GRAPHS.max_graphs = before


@contextlib.contextmanager
def step_kernel_only(on: bool):
    """The Triton kernel's per-step loop while ``on`` (the persistent loop turned off)."""
    if not on:
        yield
        return
    from rnndrop.kernels import persistent

    with persistent.turned_off():
        yield


def graph_memory(device: torch.device) -> int:
    """Bytes the CUDA graphs of the Triton loops hold, returned to the device when they are dropped."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    cuda_graphs.GRAPHS.clear()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return before - torch.cuda.memory_reserved(device)


def tuned(setting: dict | None) -> contextlib.AbstractContextManager:
    """The persistent loop's launch settings ``setting`` on in the block (``persistent.tuned``; the
    module, which needs Triton, imported only for a variant that has settings)."""
    if not setting:
        return contextlib.nullcontext()
    from rnndrop.kernels import persistent

    return persistent.tuned(**setting)


def with_switches(name: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with the switches of variant ``name`` on, and only of it: the Triton loops' CUDA graphs
    (:data:`GRAPHED`), the step kernel (:data:`STEP_KERNEL`, :data:`GRAPHED`), launch settings
    (:data:`TUNED`)."""

    def run():
        with graphs_on(name == GRAPHED), step_kernel_only(name in (GRAPHED, STEP_KERNEL)), \
                tuned(TUNED.get(name)):
            return fn()

    return run


def timed(fn: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def microseconds(fn: Callable[[], object], rounds: int, calls: int = 200, warmup: int = 20) -> float:
    """Median over ``rounds`` of the mean time of ``calls`` calls of ``fn`` (after ``warmup`` calls), in
    microseconds: the host's time of calls that do not wait for a device (``host_cost.py``,
    ``triton_launch_cost.py``)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes the forward pass keeps for backward (CPU) or the peak allocation (CUDA)."""
    module.zero_grad(set_to_none=True)
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
        before = torch.cuda.memory_allocated(x.device)
        torch.cuda.reset_peak_memory_stats(x.device)
        train_step(module, x)
        torch.cuda.synchronize(x.device)
        return torch.cuda.max_memory_allocated(x.device) - before
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided and not t.is_mkldnn:
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                storages[s.data_ptr()] = s.nbytes()
        else:  # opaque layouts: count the elements
            storages[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = module(x)
    out.sum().backward()
    return sum(storages.values())


def note(message: str) -> None:
    """A line of progress on stderr (the tables go to stdout)."""
    print(message, file=sys.stderr, flush=True)


def bench_shape(
    model: str, shape: str, batch: int, args: argparse.Namespace, device: torch.device, step: str = ""
) -> list[dict]:
    hidden = SHAPES[shape]
    torch.manual_seed(0)
    auto = auto_loop_kernel(torch.ones(1, device=device))
    compiled = any(name.endswith(COMPILED) for name in args.variants or ())
    variants = build_variants(model, hidden, args.layers, args.p, args.kernels, auto, compiled)
    if args.variants is not None:  # the baseline, then the variants asked for
        variants = {name: m for k, (name, m) in enumerate(variants.items())
                    if k == 0 or name.rstrip("*") in args.variants}
    if args.autocast is not None:  # whole-layer graphs and torch.compile are timed in float32 only
        for name in [n for n in variants if n.endswith((WHOLE_GRAPH, COMPILED))]:
            note(f"{model} {shape}: {name} left out under --autocast")
            del variants[name]
        variants = {name: UnderAutocast(m, AUTOCAST[args.autocast]) for name, m in variants.items()}
    for m in variants.values():
        m.to(device).train()
    variants = {name: compile_model(m) if name.endswith(COMPILED) else m for name, m in variants.items()}
    baseline = next(iter(variants))

    def leave_out(name: str, what: str, error: Exception) -> None:
        """A variant that fails here is reported and left out, not the run (the baseline's failure
        fails the case)."""
        if name == baseline:
            raise error
        note(f"{model} {shape}: {name} left out, {what} failed: "
             f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}")
        del variants[name]

    for name in [n for n in variants if n.endswith(COMPILED)]:
        try:  # compiles
            train_step(variants[name], torch.randn(args.seq_len, batch, hidden, device=device))
        except Exception as error:  # whatever dynamo, Inductor or the backend raise
            leave_out(name, "torch.compile", error)
    x = torch.randn(args.seq_len, batch, hidden, device=device)
    held = {}
    for name in [n for n in variants if n.endswith(WHOLE_GRAPH)]:
        try:  # a capture no earlier run has made (a cooperative launch, cuDNN's RNN) may be refused
            held[name] = graph_whole_layer(variants[name], x)
        except Exception as error:
            leave_out(name, "the CUDA-graph capture", error)
    step_fn = STEPS[args.mode]
    # mc-predict: a variant's call draws --samples samples, the baseline's is one inference forward
    samples = {name: args.samples if args.mode == "mc-predict" and name != baseline else 1
               for name in variants}
    # through mc_predict at --samples 1 too
    predicted = {name for name in variants if args.mode == "mc-predict" and name != baseline}
    calls = {name: with_switches(name, (lambda m=m, n=samples[name]: mc_predict_step(m, x, n))
                                 if name in predicted else (lambda m=m: step_fn(m, x)))
             for name, m in variants.items()}

    first = {}
    for name in list(variants):
        variants[name].zero_grad(set_to_none=True)
        try:  # the first call of a variant no GPU has run yet (a new loop setting) may fail
            first[name] = timed(calls[name], device)
        except Exception as error:
            leave_out(name, "the first call", error)
    names = list(variants)
    for _ in range(args.warmup - 1):
        for name in names:
            variants[name].zero_grad(set_to_none=True)
            calls[name]()
    round_seconds = sum(first.values())  # the first calls: an upper bound of a round
    note(f"{step}{model} {shape} (hidden {hidden}, batch {batch}): {len(names)} variants, {args.rounds} "
         f"rounds, up to about {round_seconds * args.rounds:.0f} s{persistent_plan(x, batch, model)}")
    pipelines = fitted_pipelines(_PIPELINES_SHOWN)
    if pipelines:
        note(f"  pipelines: {pipelines}")
    load_before = os.getloadavg()[0]
    times: dict[str, list[float]] = {name: [] for name in names}
    # a running order of its own a shape: the same seed gave every shape the same orders, so that
    # whatever a variant's place in a round costs (the sixth round: two variants of one launch
    # 3-9% apart at every shape) showed as a difference of the variants at every shape alike
    rng = random.Random(f"{model} {hidden} {batch}")
    for done in range(args.rounds):
        if done and done % max(1, args.rounds // 3) == 0:
            note(f"  round {done}/{args.rounds}")
        order = names[:]
        rng.shuffle(order)
        for name in order:
            variants[name].zero_grad(set_to_none=True)
            times[name].append(timed(calls[name], device))
    load_after = os.getloadavg()[0]
    for name in names:  # per sample
        first[name] /= samples[name]
        times[name] = [t / samples[name] for t in times[name]]
    memory = {}
    if args.memory and args.mode == "train":
        memory = {name: with_switches(name, lambda m=variants[name]: saved_bytes(m, x))() for name in names}

    if GRAPHED in variants:
        held[GRAPHED] = graph_memory(device)
    rows = []
    for name in names:
        t = sorted(times[name])
        med = statistics.median(t)
        q1, q3 = (statistics.quantiles(t, n=4)[i] for i in (0, 2)) if len(t) > 1 else (med, med)
        ratio = statistics.median(a / b for a, b in zip(times[name], times[baseline]))
        row = dict(
            model=model,
            shape=shape,
            hidden=hidden,
            batch=batch,
            variant=name,
            median_s=med,
            spread=(q3 - q1) / med,
            ratio=ratio,
            words_per_s=batch * args.seq_len / med,
            first_call_s=first[name],
            times_s=times[name],
            load=[load_before, load_after],
            samples_per_call=samples[name],
        )
        if name in held:
            row["graph_memory_bytes"] = held[name]
        graphed_baseline = baseline + WHOLE_GRAPH
        if name.endswith(WHOLE_GRAPH) and name != graphed_baseline and graphed_baseline in times:
            # the GPU's time alone: both replayed from graphs, in the same rounds
            row["ratio_to_graphed_baseline"] = statistics.median(
                a / b for a, b in zip(times[name], times[graphed_baseline]))
        if memory:
            row["memory_bytes"] = memory[name]
            row["memory_ratio"] = memory[name] / memory[baseline] if memory[baseline] else None
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'model':5} {'hidden':>6} {'batch':>5} {'variant':22} {'ms':>8} {'±':>5} {'x base':>7} "
        f"{'words/s':>8} {'first ms':>9} {'mem MB':>7} {'x base':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        mem = f"{r['memory_bytes'] / 2**20:7.1f} {r['memory_ratio']:6.2f}" if "memory_bytes" in r else ""
        lines.append(
            f"{r['model']:5} {r['hidden']:6d} {r['batch']:5d} {r['variant']:22} {r['median_s'] * 1e3:8.1f} "
            f"{r['spread'] * 100:4.0f}% {r['ratio']:7.2f} {r['words_per_s']:8.0f} "
            f"{r['first_call_s'] * 1e3:9.1f} {mem}"
        )
    return "\n".join(lines)


def machine() -> str:
    """CPU model, cores, torch, BLAS and oneDNN of this machine on one line, its memory setup
    (:func:`memory_setup`) on a second."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    onednn = re.search(r"oneDNN v([\d.]+)|MKL-DNN v([\d.]+)", config)
    onednn_text = "oneDNN " + next(g for g in onednn.groups() if g) if onednn else "oneDNN ?"
    if not torch.backends.mkldnn.is_available():
        onednn_text = "no oneDNN"
    used = "on" if onednn_enabled(torch.ones(1)) else "off"
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"BLAS {blas.group(1) if blas else '?'}, {onednn_text} (loop kernels' products: {used}), "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
        f"\n{memory_setup()}"
    )


def gpu_setup(device: torch.device) -> str:
    """The GPU, its driver (``nvidia-smi``), CUDA, torch and Triton versions on one line."""
    props = torch.cuda.get_device_properties(device)
    try:
        index = f"-i={device.index or 0}"
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", index]
        driver = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "? (no nvidia-smi)"
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "not installed"
    return (
        f"GPU {props.name} ({props.total_memory / 2**30:.0f} GiB, capability {props.major}.{props.minor}), "
        f"driver {driver}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
        f"torch {torch.__version__}, Triton {triton}"
    )


def set_tf32(choice: str) -> None:
    """``--tf32``: "on" / "off" set cuDNN's and cuBLAS's float32 products alike; "default" leaves them."""
    if choice != "default":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = choice == "on"


def float32_products() -> str:
    """How float32 products run on CUDA: cuDNN's (``nn.LSTM``, and the Triton kernel, which follows
    cuDNN's switch) and cuBLAS's (WeightDrop's and other code's)."""
    names = {"ieee": "IEEE float32", "tf32": "TF32"}
    cudnn = names["tf32" if cudnn_rnn_tf32() else "ieee"]
    cublas = matmul_precision()
    cublas = names.get(cublas, cublas)
    return f"float32 products: cuDNN (nn.LSTM / nn.GRU) and the Triton kernel {cudnn}, other cuBLAS {cublas}"


#: The goals of docs/gpu.md (issue 22), as (variant, largest ratio to the baseline): the per-sequence
#: masks on the loop kernel (hidden 200: 2x), batch-shared masks and WeightDrop (1.05x).
#: Issue 41's goals on CUDA, as ratios to cuDNN: the exact masks on the Triton kernel (tied) within
#: 0.5x at hidden 200 and 650 and 1.0x at 1500, per-step and per-gate masks within 10% of tied,
#: batch-shared masks and WeightDrop within 1.05x, peak memory no more than cuDNN's.
GOALS = {"sequence": 0.5, "batch/fused": 1.05, "weight_drop": 1.05}
LARGE_HIDDEN_GOAL = 1.0
OF_TIED = {"step": 1.1, "gates": 1.1}
MEMORY_GOAL = 1.0


def goal_rows(rows: list[dict], auto: str) -> list[str]:
    """One line per (model, hidden, batch, variant) that a goal names: time and memory ratio to
    the baseline (cuDNN on CUDA), the goal and whether it is met (per-step and per-gate masks:
    their time over the tied masks' in the same case)."""
    lines = [f"{'model':5} {'hidden':>6} {'batch':>5} {'variant':22} {'x base':>7} {'goal':>5} "
             f"{'mem x':>6} {'goal':>5}  met"]
    tied = {(r["model"], r["hidden"], r["batch"]): r["ratio"] for r in rows
            if r["variant"].rstrip("*") == f"sequence/{auto}"}
    for r in rows:
        name = r["variant"].rstrip("*")
        scope = name.split("/")[0]
        case = (r["model"], r["hidden"], r["batch"])
        ratio, memory = r["ratio"], r.get("memory_ratio")
        if name == f"sequence/{auto}":
            goal = LARGE_HIDDEN_GOAL if r["hidden"] >= 1500 else GOALS["sequence"]
        elif name in GOALS:
            goal = GOALS[name]
        elif name == f"{scope}/{auto}" and scope in OF_TIED and case in tied:
            goal, ratio, memory = OF_TIED[scope], ratio / tied[case], None  # against tied, not cuDNN
        else:
            continue
        met = ratio <= goal and (memory is None or memory <= MEMORY_GOAL)
        mem = f"{memory:6.2f} {MEMORY_GOAL:5.2f}" if memory is not None else f"{'-':>6} {'-':>5}"
        lines.append(f"{r['model']:5} {r['hidden']:6d} {r['batch']:5d} {r['variant']:22} "
                     f"{ratio:7.2f} {goal:5.2f} {mem}  {'yes' if met else 'NO'}")
    return lines


def memory_setup() -> str:
    """How fresh memory reaches the process, in one line: the kernel's transparent-hugepage
    mode and any allocator settings in the environment. Page faults on fresh buffers cost
    nn.LSTM as much as the loop kernels (see the README's speed section), so two machines
    compare only under the same setup."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = re.search(r"\[(\w+)\]", f.read())
        thp = mode.group(1) if mode else "?"
    except OSError:
        thp = "?"
    settings = [
        f"{key}={value}" for key, value in sorted(os.environ.items())
        if key.startswith("MALLOC_") or key in ("GLIBC_TUNABLES", "LD_PRELOAD")
    ]
    allocator = " ".join(settings) or "none (defaults)"
    return f"memory: transparent hugepages {thp}, allocator settings {allocator}"


# Ops that only make views or allocate: no kernel launch on a GPU.
NO_LAUNCH = {
    "aten::" + name
    for name in [
        "slice",
        "as_strided",
        "split_with_sizes",
        "split",
        "view",
        "unsqueeze",
        "t",
        "select",
        "narrow",
        "reshape",
        "empty",
        "transpose",
        "expand",
        "alias",
        "detach",
        "empty_like",
        "new_empty",
        "_reshape_alias",
        "unbind",
        "permute",
        "contiguous",
        "lift_fresh",
        "resize_",
        "empty_strided",
        "chunk",
        "result_type",
        "_unsafe_view",
        "new_empty_strided",
    ]
}


def top_level_ops(prof) -> collections.Counter:
    """Top-level ATen / oneDNN ops of a profile, by name (an op called by another is part of it)."""

    def nested(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith(("aten::", "mkldnn::")):
                return True
            parent = parent.cpu_parent
        return False

    return collections.Counter(
        e.name for e in prof.events() if e.name.startswith(("aten::", "mkldnn::")) and not nested(e)
    )


def launching_ops(prof) -> collections.Counter:
    """:func:`top_level_ops` without views and allocations: on a GPU each is one kernel launch."""
    return collections.Counter({name: n for name, n in top_level_ops(prof).items() if name not in NO_LAUNCH})


def count_ops(
    kernel: str, cell: str, steps: int, onednn: bool
) -> tuple[collections.Counter, collections.Counter]:
    """Launching ops of one layer's forward and backward over ``steps`` time steps
    (batch 4, hidden 16, a per-sequence hidden mask)."""
    B, H, G = 4, 16, 4 if cell == "lstm" else 3
    gates_x = torch.randn(steps * B, G * H, requires_grad=True)
    h0 = torch.zeros(B, H, requires_grad=True)
    w_hh = torch.randn(G * H, H, requires_grad=True)
    mask = torch.rand(1, B, H)
    if cell == "lstm":
        rest = (h0, torch.zeros(B, H, requires_grad=True), w_hh, None, mask)
    else:
        rest = (h0, w_hh, torch.randn(G * H, requires_grad=True), mask)
    with torch.backends.mkldnn.flags(enabled=onednn):
        with profile(activities=[ProfilerActivity.CPU]) as forward:
            out = get_kernel(kernel, cell)(gates_x, [B] * steps, *rest)[0]
        with profile(activities=[ProfilerActivity.CPU]) as backward:
            out.backward(torch.ones_like(out))
    return launching_ops(forward), launching_ops(backward)


def print_op_counts() -> None:
    """Ops per time step (the difference between 20 and 10 steps, over 10) of every loop kernel."""
    print("launching ops per time step of one layer and direction (profiler, CPU):")
    for kernel in KERNELS:
        if kernel == "triton":  # CUDA only; its launches are fixed by construction
            print("  triton   (CUDA) one launch runs every step of a layer and direction, forward and"
                  " backward (rnndrop/kernels/persistent.py); where its plan cannot (proj_size, a batch"
                  " or hidden size past the grid), forward 2, backward 2 per step and direction (4 and 4"
                  " with proj_size): a cuBLAS product and a fused Triton kernel each way"
                  " (rnndrop/kernels/triton_lstm.py)")
            continue
        for cell in ("lstm", "gru"):
            for onednn in (True, False):
                long, short = count_ops(kernel, cell, 20, onednn), count_ops(kernel, cell, 10, onednn)
                per_step = [{k: (a[k] - b[k]) / 10 for k in a if a[k] != b[k]} for a, b in zip(long, short)]
                print(
                    f"  {kernel:8} {cell:4} {'oneDNN' if onednn else 'torch.mm':8} "
                    f"forward {sum(per_step[0].values()):4.1f}, backward {sum(per_step[1].values()):4.1f}"
                )
                for name, ops in zip(("forward", "backward"), per_step):
                    listing = ", ".join(f"{k.split('::')[1]} {v:g}" for k, v in sorted(ops.items()))
                    print(f"      {name}: {listing}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="small,medium", help="comma-separated: small, medium, large")
    parser.add_argument("--models", default="lstm,gru", help="comma-separated: lstm, gru")
    parser.add_argument(
        "--kernels", default=None, help="loop kernels to time (default: those that run on the device)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--batch", default="20", help="comma-separated batch sizes, e.g. 20,64,128")
    parser.add_argument("--seq-len", type=int, default=35)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--p", type=float, default=0.5, help="every dropout probability")
    parser.add_argument("--mode", default="train", choices=sorted(STEPS),
                        help="train: forward + backward (default); mc-eval: forward, fresh masks, no grad; "
                             "mc-predict: --samples samples through rnndrop.mc.mc_predict, time per sample")
    parser.add_argument("--samples", type=int, default=20,
                        help="mc-predict: Monte-Carlo samples a call draws (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="calls per variant before timing")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--tf32", default="default", choices=["default", "on", "off"],
                        help="CUDA float32 products: torch's defaults (cuDNN, so nn.LSTM and the Triton "
                             "kernel, in TF32; other cuBLAS products in IEEE), or all TF32, or all IEEE")
    parser.add_argument("--autocast", default=None, choices=sorted(AUTOCAST),
                        help="every variant's forward (the baseline's too) under torch.autocast in it")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variants to time besides the baseline, as the table names "
                             "them without '*' (default: all)")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip memory")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument(
        "--count-ops", action="store_true", help="print the ops per time step of every loop kernel and exit"
    )
    args = parser.parse_args(argv)
    if args.json and (why := unwritable(args.json)):  # said before measuring, not after
        parser.error(f"--json {args.json!r}: {why}")
    if args.count_ops and args.json:  # it prints a table of its own and writes nothing
        parser.error("--count-ops prints the ops per step and exits: it writes no --json")
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.models = [m for m in args.models.split(",") if m]
    try:
        args.device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device: expected cpu or cuda[:N], got {args.device!r}")
    if args.device.type not in ("cpu", "cuda"):
        parser.error(f"--device: expected cpu or cuda[:N], got {str(args.device)!r}")
    if not args.shapes or not args.models:
        parser.error(f"--shapes and --models: expected a name each at least, got {args.shapes} and "
                     f"{args.models}")
    if not 0 <= args.p < 1:
        parser.error(f"--p: expected a probability in [0, 1), got {args.p}")
    for name in ("seq_len", "layers", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, got {value}")
    runs_here = [k for k in KERNELS if k != ("compiled" if args.device.type == "cuda" else "triton")]
    args.kernels = runs_here if args.kernels is None else [k for k in args.kernels.split(",") if k]
    try:
        args.batch = [int(b) for b in args.batch.split(",") if b]
    except ValueError:
        parser.error(f"--batch: expected comma-separated positive integers, got {args.batch!r}")
    if not args.batch or min(args.batch) < 1:
        parser.error(f"--batch: expected comma-separated positive integers, got {args.batch!r}")
    for s in args.shapes:
        if s not in SHAPES:
            parser.error(f"--shapes: expected names from {', '.join(SHAPES)}, got {s!r}")
    for m in args.models:
        if m not in ("lstm", "gru"):
            parser.error(f"--models: expected lstm or gru, got {m!r}")
    for k in args.kernels:
        if k not in KERNELS:
            parser.error(f"--kernels: expected names from {', '.join(KERNELS)}, got {k!r}")
        if k not in runs_here:
            here = ", ".join(runs_here)
            parser.error(f"--kernels: on {args.device.type} expected one of {here}, got {k!r}")
    if args.variants is not None:
        args.variants = [v for v in args.variants.split(",") if v]
        known = {name.rstrip("*") for model in ("lstm", "gru")
                 for name in build_variants(model, 1, 1, 0.0, args.kernels, compiled=True)}
        unknown = [v for v in args.variants if v not in known]
        if unknown or not args.variants:  # else only the baseline would be timed
            parser.error(f"--variants: expected names among {', '.join(sorted(known))}, "
                         f"got {unknown or 'none'}")
    if args.rounds < 1 or args.warmup < 1:
        parser.error("--rounds and --warmup must be at least 1")
    if args.samples < 1:
        parser.error(f"--samples: expected a positive integer, got {args.samples}")
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    # `timeout` (gpu_check.sh's time limits) sends SIGTERM: stop as Ctrl-C does, tables and JSON of
    # the finished cases kept
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        _run(argv)
    except KeyboardInterrupt:
        note("interrupted: the tables printed above (and --json's cases) are complete; "
             "the others were not timed")
        sys.exit(130)


def _run(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        resolve_device(args.device)  # a GPU this machine lacks: one line, not torch's AssertionError
    except ValueError as error:
        print(f"speed.py: error: --{error}", file=sys.stderr)
        sys.exit(2)
    # kernel="auto" would time "manual" while the compiled kernel builds in the background: build first
    os.environ.setdefault("RNNDROP_COMPILE_WAIT", "1")
    if args.count_ops:
        print(machine())
        print_op_counts()
        return
    device = args.device
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    set_tf32(args.tf32)
    auto = auto_loop_kernel(torch.ones(1, device=device))
    header = (
        f"{machine()}\n"
        + (f"{gpu_setup(device)}\n{float32_products()}\n" if device.type == "cuda" else "")
        + f"device {device}, {torch.get_num_threads()} threads, {args.mode}, "
        f"batch {','.join(map(str, args.batch))}, seq {args.seq_len}, {args.layers} layers, p {args.p}, "
        f"{args.rounds} rounds, load average {os.getloadavg()[0]:.2f}"
        + (f", forward under autocast in {args.autocast}" if args.autocast else "") + "\n"
        f"kernel='auto' runs the loop kernel {auto!r}"
    )
    print(header, flush=True)
    rows: list[dict] = []
    failed: list[dict] = []
    cases = [(shape, model, batch) for shape in args.shapes for model in args.models for batch in args.batch]
    config = dict(vars(args), device=str(device), header=header)

    def save(complete: bool) -> None:
        """--json after every case (a time limit that stops the run keeps the cases done)."""
        if args.json:
            write_json_atomic(dict(config=config, results=rows, failed=failed, complete=complete), args.json)

    for i, (shape, model, batch) in enumerate(cases, 1):
        try:
            shape_rows = bench_shape(model, shape, batch, args, device, step=f"[{i}/{len(cases)}] ")
        except Exception as error:  # the baseline failed: the next case may still run
            reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
            note(f"{model} {shape} batch {batch}: failed, left out: {reason}")
            failed.append(dict(model=model, shape=shape, batch=batch, error=reason))
            save(complete=False)
            continue
        rows += shape_rows
        print(format_table(shape_rows), flush=True)
        for r in shape_rows:
            if r.get("graph_memory_bytes") is not None:
                held = r["graph_memory_bytes"] / 2**20
                print(f"{r['variant']}: its CUDA graphs held {held:.1f} MB between calls", flush=True)
            if r.get("ratio_to_graphed_baseline") is not None:
                print(f"{r['variant']}: {r['ratio_to_graphed_baseline']:.2f}x {r['model']}'s baseline "
                      "replayed from CUDA graphs too (the GPU's time alone)", flush=True)
        if args.mode == "mc-predict":
            print(f"mc-predict: times per sample; each variant's call drew {args.samples} samples through "
                  "rnndrop.mc.mc_predict, the baseline's call is one inference forward", flush=True)
        loads = shape_rows[0]["load"]
        print(f"load average during timing: {loads[0]:.2f} -> {loads[1]:.2f}\n", flush=True)
        save(complete=False)
    if device.type == "cuda":
        print("against the goals of docs/gpu.md (baseline: cuDNN):\n" + "\n".join(goal_rows(rows, auto)))
    save(complete=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
