#!/usr/bin/env bash
# One call on a lent GPU machine (docs/gpu.md, "How to measure"): the Triton kernel compiled and
# checked against the reference kernel, then timed against cuDNN. Every step has its own time limit,
# so a hang in one still leaves the others' numbers. Logs and JSON go to $OUT (default: gpu-out/).
#
#   bash benchmarks/gpu_check.sh                    # machine checks tests speed tf32 mc profile lms (9 min, H200)
#   bash benchmarks/gpu_check.sh checks tf32 lms    # some of them: machine checks tests buffers speed amp tf32 mc
#                                                   # profile loop_profile tuning projection host_profile lms
#                                                   # compile mc_compile
#                                                   # weight_drop_memory lengths
#   DEADLINE=540 BUNDLE=x.tgz bash benchmarks/gpu_check.sh ...   # for a lease: below
#   DEADLINE=560 BUNDLE=x.tgz bash benchmarks/gpu_check.sh lease1  # the next lease's first call; lease2
#
# DEADLINE (seconds from the start) makes one call end inside its limit: the steps run in the order
# named, each step's time limits are cut to what is left of it, and a step that would start with
# under 30 s left is skipped (and says so). BUNDLE names a .tgz of everything written to $OUT (a
# lease returns a few files, not dozens).
set -u
OUT=${OUT:-gpu-out}
DEADLINE=${DEADLINE:-}
if [[ -n "$DEADLINE" && ! "$DEADLINE" =~ ^[0-9]+$ ]]; then
    echo "gpu_check.sh: DEADLINE must be whole seconds, got '$DEADLINE'" >&2; exit 2
fi
if [ -n "${BUNDLE:-}" ] && [[ "$(realpath -m "$BUNDLE")" == "$(realpath -m "$OUT")"/* ]]; then
    echo "gpu_check.sh: BUNDLE must be outside OUT (it packs OUT), got BUNDLE=$BUNDLE OUT=$OUT" >&2; exit 2
fi
mkdir -p "$OUT"
# everything printed is kept in $OUT too (a lease's reply keeps only the output's last 12,000 characters)
exec > >(tee -a "$OUT/console.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the CPU's C++ loop kernel is not used on a GPU: the tests' session fixture would build it (1-4 min)
export RNNDROP_NO_COMPILE=1
unset TRITON_INTERPRET
PY=${PYTHON:-python3}

step() { echo; echo "=== $1 ($(date +%T))"; }

bundle() {  # BUNDLE: a .tgz of $OUT, remade after every step (a call cut short still returns one)
    if [ -n "${BUNDLE:-}" ]; then tar czf "$BUNDLE.part" -C "$OUT" . && mv "$BUNDLE.part" "$BUNDLE"; fi
}

speed_failed() {  # a speed.py run that failed or was stopped: its last lines of stderr on the console
    echo "speed.py stopped or failed ($1): the end of $OUT/speed.err:"; tail -n 5 "$OUT/speed.err"
}

err_lines() {  # speed.err's line count: a step reads only the lines its own run appended after it
    if [ -f "$OUT/speed.err" ]; then wc -l <"$OUT/speed.err"; else echo 0; fi
}

limit() {  # a time limit of $1 s, cut to what DEADLINE leaves (at least 1 s)
    if [ -z "$DEADLINE" ]; then echo "$1"; return; fi
    local left=$((DEADLINE - SECONDS))
    echo $((left < $1 ? (left > 1 ? left : 1) : $1))
}

machine() {
step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu \
    --format=csv 2>&1
$PY -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, 'cuda', torch.version.cuda, \
'cudnn', torch.backends.cudnn.version(), 'triton', triton.__version__, torch.cuda.get_device_name())"
nproc
$PY -c "from rnndrop.kernels import persistent as p; print('persistent loop: cooperative launches', p._COOPERATIVE)"
}

checks() {
step "kernels against the reference kernel, compiled (tests/triton_checks.py)"
# The random configurations compile a dozen more shapes (a minute of a short lease), and draw the
# shapes the others leave out (they would have caught the one-program loop's early loads):
# CHECKS_QUICK=1 leaves them out
local select=()
[ -n "${CHECKS_QUICK:-}" ] && select=(-k "not random_configurations")
timeout -s INT -k 10 $(limit 240) $PY -m pytest -q -p no:cacheprovider -n 8 --timeout $(limit 180) tests/triton_checks.py "${select[@]}" 2>&1 \
    | tee "$OUT/triton-checks.log" | tail -n 40
}

tests() {
step "the layers on CUDA (auto picks triton), CUDA graphs, cuDNN given masked weights without a copy"
timeout -s INT -k 10 $(limit 150) $PY -m pytest -q -p no:cacheprovider --timeout $(limit 100) tests/test_cuda_graphs.py \
    tests/test_triton_kernel.py tests/test_traced_layers.py -k "not match_the_reference and (cuda or triton)" \
    2>&1 | tee "$OUT/cuda-tests.log" | tail -n 30
buffers
}

buffers() {
step "cuDNN runs the masked weights' buffers as they are: no compaction, no flatten (odd sizes too)"
timeout -s INT -k 10 $(limit 60) $PY -m pytest -q -p no:cacheprovider --timeout $(limit 50) tests/test_batch_scope.py tests/test_weight_drop.py \
    tests/test_flat_weights.py tests/test_awd_recipe.py -k "on_cuda" 2>&1 | tee -a "$OUT/cuda-tests.log" | tail -n 10
}

weight_drop_memory() {
step "WeightDrop's peak memory in a training step: the op on the masked views, or the module's forward (a hook)"
# A wrapped RNN with a hook goes through its own forward, which flattens the views into a buffer of
# its own at every call (the path before 2026-11-26's seventh session): the A/B of that change.
timeout -k 10 $(limit 60) $PY - <<'MEMORY' 2>&1 | tee "$OUT/weight-drop-memory.txt"
import torch
from torch import nn
from rnndrop import WeightDrop

for hidden in (650, 1500):
    x = torch.randn(35, 20, hidden, device="cuda")
    for name in ("nn.LSTM", "WeightDrop, op on the views", "WeightDrop, module forward"):
        lstm = nn.LSTM(hidden, hidden, 2).cuda()
        module = lstm if name == "nn.LSTM" else WeightDrop(lstm, ["weight_hh_l0", "weight_hh_l1"], p=0.5)
        if name.endswith("forward"):
            lstm.register_forward_hook(lambda *args: None)
        for _ in range(3):
            module.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            module(x)[0].sum().backward()
            torch.cuda.synchronize()
        print(f"hidden {hidden:4d}, batch 20: {name:28s} peak {(torch.cuda.max_memory_allocated() - before) / 2**20:7.1f} MiB"
              f" above the start, {(torch.cuda.memory_allocated() - before) / 2**20:7.1f} MiB held after")
MEMORY
}

speed() {
step "training speed against cuDNN, torch's defaults (cuDNN TF32, cuBLAS IEEE)"
# SPEED_SHAPES, SPEED_BATCH, SPEED_VARIANTS (speed.py --variants) and SPEED_TIMEOUT narrow it
timeout -k 10 $(limit ${SPEED_TIMEOUT:-300}) $PY benchmarks/speed.py --device cuda --shapes ${SPEED_SHAPES:-small,medium,large} \
    --batch ${SPEED_BATCH:-20,64,128} ${SPEED_VARIANTS:+--variants $SPEED_VARIANTS} --kernels triton \
    --rounds ${ROUNDS:-8} --json "$OUT/gpu-speed-train.json" 2>>"$OUT/speed.err" >"$OUT/gpu-speed-train.txt" \
    || speed_failed gpu-speed-train
# the goals' table last and whole (the reply keeps the output's end); the rows above it cut
grep -E "^(lstm|gru) |GPU's time alone" "$OUT/gpu-speed-train.txt" \
    | grep -vE "^(lstm|gru) +[0-9]+ +[0-9]+ +nn\.(LSTM|GRU) " | grep -vE "(yes|NO)$" | head -n 60
grep -E "^(lstm|gru) .*(yes|NO)$" "$OUT/gpu-speed-train.txt"
}

amp() {
step "training speed with the forward under autocast (bfloat16): the loop against cuDNN, and the 'manual' kernel it replaced there"
# AMP_SHAPES, AMP_BATCH and AMP_DTYPE (bfloat16 or float16) set its size
timeout -k 10 $(limit ${AMP_TIMEOUT:-150}) $PY benchmarks/speed.py --device cuda --shapes ${AMP_SHAPES:-small,medium} \
    --batch ${AMP_BATCH:-20,128} --kernels triton,manual --autocast ${AMP_DTYPE:-bfloat16} --rounds ${ROUNDS:-4} \
    --variants sequence/triton,sequence/manual,gates/triton,batch/fused,weight_drop \
    --json "$OUT/gpu-speed-amp.json" 2>>"$OUT/speed.err" >"$OUT/gpu-speed-amp.txt" || speed_failed gpu-speed-amp
grep -E "^(lstm|gru) " "$OUT/gpu-speed-amp.txt" | grep -vE "(yes|NO)$"
}

compile() {
step "torch.compile(mode='reduce-overhead'), allow_rnn: the layers traced, each recurrence an operator, steps from CUDA graphs"
local before; before=$(err_lines)
# COMPILE_SHAPES, COMPILE_MODELS (lstm,gru doubles it), COMPILE_VARIANTS (gates+compile and
# batch+compile besides) and COMPILE_TIMEOUT set its size; each +compile variant compiles once a shape
# (tens of seconds)
timeout -k 10 $(limit ${COMPILE_TIMEOUT:-240}) $PY benchmarks/speed.py --device cuda --shapes ${COMPILE_SHAPES:-small,medium} \
    --batch 20 --models ${COMPILE_MODELS:-lstm} --kernels triton --rounds ${ROUNDS:-8} --no-memory \
    --variants ${COMPILE_VARIANTS:-nn.LSTM+compile,nn.GRU+compile,sequence+compile,none/triton+compile,sequence/triton,nn.LSTM+graph,nn.GRU+graph,sequence+graph} \
    --json "$OUT/gpu-speed-compile.json" 2>>"$OUT/speed.err" >"$OUT/gpu-speed-compile.txt" \
    || speed_failed gpu-speed-compile
grep -E "^(lstm|gru) |GPU's time alone" "$OUT/gpu-speed-compile.txt"
tail -n +$((before + 1)) "$OUT/speed.err" | grep -E "left out" | tail -n 4
}

mc_compile() {
step "Monte-Carlo prediction under torch.compile (rnndrop.compile_model, steps from CUDA graphs), per sample"
local before; before=$(err_lines)
timeout -k 10 $(limit ${COMPILE_TIMEOUT:-240}) $PY benchmarks/speed.py --device cuda --shapes ${COMPILE_SHAPES:-small,medium} \
    --batch 20 --models ${COMPILE_MODELS:-lstm} --mode mc-predict --samples 20 --kernels triton --no-memory \
    --rounds ${ROUNDS:-8} --variants sequence/triton,sequence+compile --json "$OUT/gpu-speed-mc-compile.json" \
    2>>"$OUT/speed.err" >"$OUT/gpu-speed-mc-compile.txt" \
    || speed_failed gpu-speed-mc-compile
grep -E "^(lstm|gru) " "$OUT/gpu-speed-mc-compile.txt"
tail -n +$((before + 1)) "$OUT/speed.err" | grep -E "left out" | tail -n 4
}

tf32() {
for tf32 in on off; do
    step "training speed, the Triton kernel, every float32 product in ${tf32/on/TF32}${tf32/off/IEEE}"
    timeout -k 10 $(limit 80) $PY benchmarks/speed.py --device cuda --shapes medium,large --batch 20,128 --kernels triton \
        --tf32 $tf32 --rounds ${ROUNDS:-8} --no-memory --json "$OUT/gpu-speed-tf32-$tf32.json" \
        2>>"$OUT/speed.err" >"$OUT/gpu-speed-tf32-$tf32.txt" || speed_failed gpu-speed-tf32-$tf32
    grep -E "^(lstm|gru) .*(nn\.|sequence/triton|batch|weight)" "$OUT/gpu-speed-tf32-$tf32.txt"
done
}

mc() {
step "Monte-Carlo forward speed against cuDNN"
timeout -k 10 $(limit 60) $PY benchmarks/speed.py --device cuda --shapes small,medium --batch 20,64 --mode mc-eval \
    --kernels triton --rounds ${ROUNDS:-8} --json "$OUT/gpu-speed-mc.json" 2>>"$OUT/speed.err" \
    >"$OUT/gpu-speed-mc.txt" || speed_failed gpu-speed-mc
grep -E "^(lstm|gru) .*(sequence/triton|batch)" "$OUT/gpu-speed-mc.txt"
step "Monte-Carlo prediction through rnndrop.mc (20 samples a call, stacked), per sample, against cuDNN's inference"
timeout -k 10 $(limit 60) $PY benchmarks/speed.py --device cuda --shapes small,medium --batch 20,64 --mode mc-predict \
    --samples 20 --kernels triton --variants sequence/triton,batch/fused --rounds ${ROUNDS:-8} \
    --json "$OUT/gpu-speed-mc-predict.json" 2>>"$OUT/speed.err" >"$OUT/gpu-speed-mc-predict.txt" \
    || speed_failed gpu-speed-mc-predict
grep -E "^(lstm|gru) .*(sequence/triton|batch)" "$OUT/gpu-speed-mc-predict.txt"
}

profile() {
step "where batch-shared masks and WeightDrop spend a training step (LSTM 650, batch 20)"
timeout -k 10 $(limit 60) $PY - <<'PROFILE' 2>&1 | tee "$OUT/profile.txt" | head -n 60
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from rnndrop import VariationalLSTM
from rnndrop.weight_drop import WeightDrop

p = 0.5
variants = {
    "nn.LSTM": nn.LSTM(650, 650, 2),
    "batch/fused": VariationalLSTM(650, 650, 2, mask_scope="batch", dropout=p, dropout_input=p,
                                   dropout_hidden=p, dropout_output=p),
    "weight_drop": WeightDrop(nn.LSTM(650, 650, 2), ["weight_hh_l0", "weight_hh_l1"], p=p),
}
x = torch.randn(35, 20, 650, device="cuda")
for name, module in variants.items():
    module.cuda().train()
    for _ in range(5):
        module(x)[0].sum().backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            module(x)[0].sum().backward()
        torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
    print(f"== {name}: {launches / 10:.0f} kernel launches a step")
    print(events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=44))
PROFILE
}

loop_profile() {
step "where a tied-mask training step spends GPU time (LSTM, 2 layers, batch 20, the persistent loop)"
timeout -k 10 $(limit 90) $PY - <<'PROFILE' 2>&1 | tee "$OUT/loop-profile.txt" | head -n 40
import torch
from torch.profiler import ProfilerActivity, profile
from rnndrop import VariationalLSTM

for hidden in (200, 650, 1500):
    layer = VariationalLSTM(hidden, hidden, 2, dropout=0.5, dropout_input=0.5, dropout_hidden=0.5,
                            dropout_output=0.5).cuda()
    x = torch.randn(35, 20, hidden, device="cuda")
    for _ in range(3):
        layer(x)[0].sum().backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            layer(x)[0].sum().backward()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) / 5 / 1e3
    print(f"== hidden {hidden}: GPU busy {total:.2f} ms a step; by kernel (ms a step):")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:5]:
        print(f"   {e.self_device_time_total / 5 / 1e3:7.3f}  x{e.count // 5:<3d} {e.key[:70]}")
PROFILE
}

tuning() {
step "the persistent loop's GPU time by launch setting; host vs GPU time of a training step"
# TUNING_CELLS: the loops to sweep (persistent_tuning.py --cells; default lstm)
timeout -k 10 $(limit 330) $PY benchmarks/persistent_tuning.py --cells "${TUNING_CELLS:-lstm}" --json "$OUT/persistent-tuning.json" 2>&1 \
    | tee "$OUT/persistent-tuning.txt" | tail -n 100
}

projection() {
step "the per-gate input projection's batched CUDA path against a masked copy per gate (float64)"
timeout -k 10 $(limit 60) $PY - <<'CHECK' 2>&1 | tee "$OUT/projection-check.txt"
import torch
from rnndrop.kernels.gates import masked_linear
from rnndrop.kernels.per_gate_projection import per_gate_projection

torch.manual_seed(0)
for x_shape, mask_shape in (((35, 20, 64), (1, 20, 4, 64)), ((35, 20, 64), (35, 20, 3, 64)), ((50, 64), (50, 4, 64))):
    gates = mask_shape[-2]
    x = torch.randn(x_shape, dtype=torch.float64, device="cuda", requires_grad=True)
    mask = (torch.rand(mask_shape, dtype=torch.float64, device="cuda") * 2).requires_grad_()
    w = torch.randn(gates * 32, 64, dtype=torch.float64, device="cuda", requires_grad=True)
    b = torch.randn(gates * 32, dtype=torch.float64, device="cuda", requires_grad=True)
    ours, ref = per_gate_projection(x, mask, w, b), masked_linear(x, mask, w, b)
    d = torch.randn_like(ref)
    errors = [float((a - r).detach().abs().max()) for a, r in zip(
        (ours, *torch.autograd.grad(ours, (x, mask, w, b), d)), (ref, *torch.autograd.grad(ref, (x, mask, w, b), d)))]
    print(x_shape, mask_shape, "largest differences", ["%.1e" % e for e in errors],
          "OK" if max(errors) < 1e-9 else "WRONG")
CHECK
}

host_profile() {
step "where the host's time goes in a tied-mask training step (LSTM 200, batch 20: host-bound)"
timeout -k 10 $(limit 90) $PY - <<'PROFILE' 2>&1 | tee "$OUT/host-profile.txt" | head -n 75
import cProfile, pstats, torch
from torch.profiler import ProfilerActivity, profile
from rnndrop import VariationalLSTM

layer = VariationalLSTM(200, 200, 2, dropout=0.5, dropout_input=0.5, dropout_hidden=0.5,
                        dropout_output=0.5).cuda()
x = torch.randn(35, 20, 200, device="cuda")
def step():
    layer.zero_grad(set_to_none=True)
    layer(x)[0].sum().backward()
for _ in range(10):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(20):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=40))
profiler = cProfile.Profile()
profiler.enable()
for _ in range(50):
    step()
torch.cuda.synchronize()
profiler.disable()
pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
PROFILE
}

lm() {  # words/s of rnndrop-lm's own training loop on CUDA (LM_DATA, default the shipped PTB sample; $2 epochs)
    local name=$1 out=runs/gpu-$1 epochs=${2:-1}; shift 2
    rm -rf "$out"  # this script's scratch: an earlier call's runs would be summed up as this one's
    timeout -k 10 $(limit $((90 * epochs))) $PY -c "import sys; from rnndrop.lm.cli import main; sys.exit(main())" \
        ptb --data "${LM_DATA:-sample}" --epochs "$epochs" --mc-samples 0 --device cuda --no-progress --out "$out" "$@" \
        >"$OUT/lm-$name.log" 2>&1 || tail -n 3 "$OUT/lm-$name.log"
    # the whole run's words/s (the first epoch's compiles count), and its last epoch's
    $PY -c "import csv, json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob('*/*/results.json')):
    r = json.loads(f.read_text())
    rows = list(csv.DictReader(f.with_name('metrics.csv').open()))
    last = float(rows[-1]['words_per_second']) if rows else float('nan')
    mode = 'compiled' if r.get('compiled') else 'eager'
    if r.get('compile_failure'):
        mode = 'eager after: ' + r['compile_failure']
    print(f'{sys.argv[1]:26} {f.parts[-3]:12} {r[\"words_per_second\"]:9.0f} words/s, last epoch {last:9.0f},'
          f' valid {r[\"best_valid_ppl\"]:.2f}, peak {r[\"peak_memory_bytes\"] / 2**30:.2f} GiB, {mode}')" "$out" \
    | tee -a "$OUT/lm-words-per-second.txt"
}
lms() {
# LMS: space-separated name:config:regimes[:flag[:epochs]] runs (default: the goal's pairs of issue 41
# as a user runs them, with rnndrop-lm's default: tied masks under torch.compile on CUDA where the
# recurrence runs the loop, none and weight_drop eagerly). zaremba-medium's config has no recurrent
# dropout (Zaremba et al.'s), so its tied run runs cuDNN with masks around it; gal-medium is the same
# model with recurrent masks (0.2): the pair that times the loop. Each for 3 epochs (the last one's
# words/s without the compiles and the start; an epoch of the sample is a second or two), AWD for 3
# and its config's 20 fine-tuning epochs (a step replayed from CUDA graphs once each truncated-BPTT
# length has been recorded); then the compiled runs again eagerly (--no-compile): what the default gains
step "rnndrop-lm on CUDA: words/s (${LMS:-zaremba-medium and gal-medium none,tied; AWD tied,weight_drop; tied again eagerly})"
for run in ${LMS:-medium:zaremba-medium:none,tied::3 gal:gal-medium:none,tied::3 awd:awd:tied,weight_drop::3 gal-eager:gal-medium:tied:no-compile:2 awd-eager:awd:tied:no-compile:1}; do
    IFS=: read -r name config regimes flag epochs <<<"$run"
    lm "$name" "${epochs:-1}" --config "$config" --regimes "$regimes" ${flag:+--$flag}
done
}

lengths() {
# rnndrop-lm's default on CUDA (tied masks compiled) where full PTB's spread of truncated-BPTT lengths
# means a CUDA graph each: AWD on 400k words of generated text (about 35 lengths in 3 epochs against
# the sample's 9), compiled and eagerly; the last epoch's words/s and the peak memory say what the
# graphs cost once recorded, the whole run's words/s what recording them cost
step "rnndrop-lm --config awd --regimes tied on 400k generated words: compiled (the default) and --no-compile"
local data=runs/gpu-lengths-data
$PY - "$data" <<'CORPUS'
import pathlib, random, sys
folder = pathlib.Path(sys.argv[1])
folder.mkdir(parents=True, exist_ok=True)
rng = random.Random(0)
vocab = [f"w{i}" for i in range(10000)]
for split, words in (("train", 400_000), ("valid", 20_000), ("test", 20_000)):
    lines, n = [], 0
    while n < words:
        k = rng.randint(5, 30)
        lines.append(" ".join(rng.choices(vocab, k=k)))
        n += k
    (folder / f"ptb.{split}.txt").write_text("\n".join(lines) + "\n")
CORPUS
LM_DATA=$data lm lengths-compiled 3 --config awd --regimes tied --finetune-epochs 0
LM_DATA=$data lm lengths-eager 2 --config awd --regimes tied --finetune-epochs 0 --no-compile
}

# The next lease's two calls (docs/gpu.md, "How to measure"), steps in the order of what they decide:
# are the kernels and the CUDA-only tests right compiled (the sixth round found the whole layer's
# CUDA-graph capture broken, fixed blind since), the table of issue 41's goals with the LSTM's spread
# programs now built in (sequence/triton-unspread times the rule before), the steps under
# torch.compile; then Monte-Carlo under torch.compile and the compiled LM default on PTB's spread of
# BPTT lengths (neither has run), and the GRU's launch sweep (never run; the LSTM's ran in the sixth).
LEASE1="machine checks tests speed compile"
LEASE2="mc_compile lengths tuning"
sections="${*:-machine checks tests speed tf32 mc profile lms}"
if [[ " $sections " == *" lease1 "* ]]; then  # the speed table's variants, the settings off until timed among them
    : "${SPEED_SHAPES:=small,medium,large}" "${SPEED_BATCH:=20,128}" "${ROUNDS:=4}"
    : "${SPEED_VARIANTS:=sequence/triton,gates/triton,sequence/triton-resident,sequence/triton-spread,sequence/triton-unspread,sequence/triton-half,batch/fused,naive/fused,weight_drop,nn.LSTM+graph,nn.GRU+graph,sequence+graph}"
fi
if [[ " $sections " == *" lease2 "* ]]; then  # the LSTM's sweep ran in the sixth round
    : "${TUNING_CELLS:=gru}"
fi
sections=${sections//lease1/$LEASE1}
sections=${sections//lease2/$LEASE2}
known=" machine checks tests buffers speed amp tf32 mc profile loop_profile tuning projection host_profile lms compile mc_compile weight_drop_memory lengths "
for name in $sections; do  # a name is run as a command: only the sections'
    if [[ "$known" != *" $name "* ]]; then
        echo "gpu_check.sh: unknown section '$name' (sections:${known% })" >&2; exit 2
    fi
done

for section in $sections; do
    for name in $section; do
        if [ -n "$DEADLINE" ] && ((DEADLINE - SECONDS < 30)); then
            step "$name skipped: $((DEADLINE - SECONDS)) s left before DEADLINE=$DEADLINE"
            continue
        fi
        "$name"
        bundle
    done
done
step "done"
bundle
if [ -n "${BUNDLE:-}" ]; then echo "bundled $OUT into $BUNDLE"; fi
