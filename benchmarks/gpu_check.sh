#!/usr/bin/env bash
# One prepared GPU check for a lent CUDA machine (the `nvidia-h200` kind): at most about 7.5 minutes (limits below add
# up to 510 s), every part time-boxed. Give the device tool's run a timeout_s of about 590.
#
#   bash benchmarks/gpu_check.sh            # from the repository root; results under $OUT (default ./out)
#
# Parts, each in its own process with its own `timeout`, so one failure or overrun does not lose the others; JSON is
# written after every row, so a part cut off by its timeout keeps what it measured:
#   1. parity        shadow replay on CUDA (learner backend auto = FlexAttention), float32 + bfloat16      <= 45 s
#   2. flex_tiny     score(backend="flex") vs "sdpa": log-prob + gradient agreement and fwd / fwd+bwd speed,
#                    tiny model, float32 + bfloat16, T = 4096                                                <= 75 s
#   3. memory        bench_rollout_memory.py, 8192-token prompt: KV bytes, max_memory_allocated, spike    <= 60 s
#   4. speed         bench_rollout_speed.py, prompt lengths 512 / 2048 / 4096                              <= 80 s
#   5. flex_wide     as 2 on the wide model (hidden 1024, 8 layers), bfloat16 + float32, T = 16384 and 4096 <= 120 s
#   6. fsdp          bench_fsdp.py: FSDP2Strategy (NCCL, one rank) vs unsharded, wide model, 3 steps of compressed
#                    rollouts + shadow replay: weight diff, log-prob gap, s / step, peak memory             <= 60 s
#   7. learner       bench_learner_overhead.py, dense and smd, per-row vs shared-prefix (packed FlexAttention),
#                    prompt 2048, 2 x 8, peak memory per learner step                                      <= 70 s
# Everything printed also goes to $OUT/log.txt; the markdown tables are collected in $OUT/summary.md.
#
# What the machine needs. Its image has torch (2.11 + CUDA), triton, lightning and torchmetrics, but
# transformers 5.17, and lit_smd needs transformers >= 5.24: on 5.17 the rollout fails (the `cache=` keyword does not
# reach the cache, so the prefill finds no prompt keys: "TypeError: cannot unpack non-iterable NoneType object";
# checked here on CPU with the 5.17 wheel). huggingface_hub 1.33, tokenizers 0.23.2 and safetensors 0.8 there satisfy
# transformers 5.24. So the lead must carry one wheel, prepared here in the repository root:
#     echo /.whl/ >> .git/info/exclude        # /.whl/ is already in .gitignore
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl transformers==5.24.0
# and call the device tool's run with carry [".whl"] and the command `bash benchmarks/gpu_check.sh`.
# This script installs .whl/*.whl into /tmp/site when the folder is there (no network needed), and stops early with a
# clear message if transformers is still older than 5.24 (if its import then complains about another package's
# version, e.g. regex, carry that wheel too). lit_smd itself is used from the checkout (PYTHONPATH), not
# installed: its other dependencies (datasets, jsonargparse, bitsandbytes) are not imported by these benchmarks.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor}
PY=${PYTHON:-python3}
START=$(date +%s)

echo "=== gpu_check $(date -u +%FT%TZ) OUT=$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv 2>&1 || true
if ls .whl/*.whl >/dev/null 2>&1; then
    echo "=== installing carried wheels: $(ls .whl)"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
if ! $PY - <<'EOF'
import sys
import torch, transformers
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (cuda {torch.version.cuda}, "
      f"available {torch.cuda.is_available()}), transformers {transformers.__version__} from {transformers.__file__}")
major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
if (major, minor) < (5, 24):
    sys.exit("transformers >= 5.24 is required (see the header of benchmarks/gpu_check.sh: carry the wheel in .whl/)")
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible")
import lit_smd.rollout  # noqa: F401  the package imports from the checkout
EOF
then
    echo "=== environment check failed: nothing measured"
    exit 1
fi

declare -A STATUS
part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo
    echo "=== [$name] start (limit ${limit}s, elapsed $(( $(date +%s) - START ))s): $*"
    local t0=$(date +%s)
    timeout --signal=INT --kill-after=15 "$limit" "$@"
    local rc=$?
    STATUS[$name]="rc=$rc $(( $(date +%s) - t0 ))s"
    echo "=== [$name] end ${STATUS[$name]}"
}

B=benchmarks
part parity 45 $PY $B/bench_parity.py --device cuda --dtypes float32 bfloat16 --backend auto \
    --json "$OUT/parity.json" --markdown "$OUT/parity.md"
part flex_tiny 75 $PY $B/bench_masked_attention.py --device cuda --models tiny --dtypes float32 bfloat16 \
    --seq-lens 4096 --backends sdpa flex --repeats 3 --json "$OUT/flex_tiny.json" --markdown "$OUT/flex_tiny.md"
part memory 60 $PY $B/bench_rollout_memory.py --device cuda --prompt-len 8192 \
    --json "$OUT/memory.json" --markdown "$OUT/memory.md"
part speed 80 $PY $B/bench_rollout_speed.py --device cuda --prompt-lens 512 2048 4096 --repeats 3 \
    --json "$OUT/speed.json" --markdown "$OUT/speed.md"
part flex_wide 120 $PY $B/bench_masked_attention.py --device cuda --models wide --dtypes bfloat16 float32 \
    --seq-lens 16384 4096 --backends sdpa flex --repeats 3 --time-budget 80 \
    --json "$OUT/flex_wide.json" --markdown "$OUT/flex_wide.md"
part fsdp 60 $PY $B/bench_fsdp.py --device cuda --model wide --steps 3 --json "$OUT/fsdp.json" --markdown "$OUT/fsdp.md"
part learner 70 $PY $B/bench_learner_overhead.py --device cuda --prompt-lens 2048 --batch 2 --modes dense smd \
    --repeats 1 --curve-prompt-lens --curve-groups --json "$OUT/learner.json" --markdown "$OUT/learner.md"

{
    echo "# GPU check $(date -u +%FT%TZ)"
    for name in parity flex_tiny memory speed flex_wide fsdp learner; do
        echo
        echo "<!-- $name: ${STATUS[$name]:-not run} -->"
        if [ -f "$OUT/$name.md" ]; then cat "$OUT/$name.md"; else echo "($name wrote no table; see log.txt and $name.json)"; fi
    done
} > "$OUT/summary.md"
echo
echo "=== summary (total $(( $(date +%s) - START ))s)"
for name in parity flex_tiny memory speed flex_wide fsdp learner; do echo "$name: ${STATUS[$name]:-not run}"; done
exit 0
