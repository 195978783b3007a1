#!/usr/bin/env bash
# The GPU check: one prepared command for the lent CUDA machine (`nvidia-h200`: one H200, torch 2.11, transformers
# 5.17, lightning, torchmetrics, triton; no datasets / jsonargparse / math-verify; no network; commands of at most
# 10 minutes; at most 8 result files). It finishes within GPU_CHECK_SECONDS (default 470 s, under 8 minutes), every part
# time-boxed, and writes 8 files to $OUT: log.txt, summary.md, tests.txt, blocks.md, learner.{json,md},
# decode.{json,md}.
#
# Here (network to PyPI), once, from the repository root (.whl/ is git-ignored):
#     python benchmarks/gpu_wheels.py download          # transformers 5.24, datasets, jsonargparse, math-verify, ...
# Then the device tool's `run` with carry [".whl"], timeout_s 600 and the command
#     bash benchmarks/gpu_check.sh
# (the steps and what each table means: benchmarks/README.md, "GPU check").
#
# Parts, each in its own process under `timeout --signal=INT` (a part cut off keeps its JSON rows and prints its table):
#   0. wheels    install the carried wheels the machine lacks into $SITE (pip --no-index --no-deps --target), put them
#                first on PYTHONPATH; stop here if transformers is still older than lit_smd needs
#   1. tests     pytest tests/kv/test_flex_cuda.py (skipped without CUDA): the FlexAttention learner forward and
#                backward against SDPA, the shadow mask replayed against the CUDA sampler, a bf16 SMD fit    <= 150 s
#   2. blocks    benchmarks/bench_flex_blocks.py: one packed layer (Qwen3-1.7B heads, 1024 + 2 x 8192) on FlexAttention,
#                forward + backward, the shadow view's block masks (keys in order: all partial, classified; keys
#                reordered by eviction, the learner's) against the dense view's, per pattern (h2o, recent, prefill);
#                and the dense teacher's slots-only pass with / without the prompt's query rows (--teacher)     <= 100 s
#   3. learner   benchmarks/gpu_learner.py: dense and SMD learner steps side by side at 8k and 7.75k
#                completions on FlexAttention: peak memory, time, ratios to dense, compilations, and a profile of
#                one more step per mode (top operators by device time)                                          <= 240 s
#   4. decode    benchmarks/gpu_decode.py: decode tokens/s of lit_smd dense and SnapKV-then-H2O at 0.5 vs transformers'
#                generate (dynamic cache; static cache + torch.compile), Qwen3-1.7B shape, 64 rows, 1024+1024 and
#                8192+1024 (DECODE_ARGS replaces these flags), eager and compiled; GPU memory after generate
#                returns                                                                                 the time left
# GPU_CHECK_PARTS (default "tests blocks learner decode") names the parts to run; LEARNER_ARGS adds flags to the
# learner part (e.g. "--masks lifetimes recent prefill"), BLOCKS_ARGS to the blocks part (e.g. "--shortest-completion
# 0.25": completions of different lengths, each view with and without the slots' lengths).
# Without a CUDA device (or with GPU_CHECK_TOY=1) every part runs at toy size on the CPU (`--toy`, seconds): the
# test suite runs it so (tests/test_gpu_check.py).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
PY=${PYTHON:-python3}
LIMIT=${GPU_CHECK_SECONDS:-470}
PARTS=" ${GPU_CHECK_PARTS:-tests blocks learner decode} "  # the parts to run, by name
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor}
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }

echo "=== gpu_check $(date -u +%FT%TZ) OUT=$OUT limit ${LIMIT}s"
TOY=${GPU_CHECK_TOY:-auto}
if [ "$TOY" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then TOY=0; else TOY=1; fi
fi
if [ "$TOY" = 1 ]; then
    ARGS=(--toy --device cpu)
    BLOCKS=(--device cpu --prompt 256 --new 384 --heads 4 --kv-heads 2 --head-dim 16 --recent 128 --repeats 1 --teacher)
    echo "=== no CUDA device (or GPU_CHECK_TOY=1): toy sizes on the CPU; the figures are meaningless"
else
    ARGS=(--device cuda)
    BLOCKS=(--device cuda --teacher)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
fi

if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "=== [wheels] installing what the machine lacks from $WHEELS into $SITE"
    if ! $PY benchmarks/gpu_wheels.py install --wheels "$WHEELS" --target "$SITE"; then
        echo "=== [wheels] failed: transformers is older than lit_smd needs; nothing measured"
        exit 1
    fi
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "=== [wheels] no $WHEELS/*.whl: using the machine's packages (python benchmarks/gpu_wheels.py download, here)"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

declare -A STATUS
part() {  # part NAME SECONDS COMMAND...: at most SECONDS, and never past the check's limit
    local name=$1 limit=$2
    shift 2
    if [[ "$PARTS" != *" $name "* ]]; then STATUS[$name]="skipped: not in GPU_CHECK_PARTS"; return; fi
    local left=$(( LIMIT - $(elapsed) ))
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    if [ "$limit" -le 5 ]; then STATUS[$name]="skipped: the check's ${LIMIT}s are spent"; return; fi
    echo
    echo "=== [$name] start (limit ${limit}s, elapsed $(elapsed)s): $*"
    local t0=$(date +%s)
    timeout --signal=INT --kill-after=15 "$limit" "$@"
    STATUS[$name]="rc=$? $(( $(date +%s) - t0 ))s"
    echo "=== [$name] end ${STATUS[$name]}"
}

part tests 150 $PY -m pytest -q -p no:cacheprovider tests/kv/test_flex_cuda.py --junit-xml=/tmp/junit.xml \
    > "$OUT/tests.txt" 2>&1
cat "$OUT/tests.txt"
read -r -a BLOCKS_EXTRA <<< "${BLOCKS_ARGS:-}"
part blocks 100 $PY benchmarks/bench_flex_blocks.py "${BLOCKS[@]}" "${BLOCKS_EXTRA[@]}" --markdown "$OUT/blocks.md"
read -r -a LEARNER <<< "${LEARNER_ARGS:-}"
part learner 240 $PY benchmarks/gpu_learner.py "${ARGS[@]}" --profile "${LEARNER[@]}" --json "$OUT/learner.json" \
    --markdown "$OUT/learner.md"
read -r -a DECODE <<< "${DECODE_ARGS:-}"
part decode 310 $PY benchmarks/gpu_decode.py "${ARGS[@]}" "${DECODE[@]}" --json "$OUT/decode.json" \
    --markdown "$OUT/decode.md"

{
    echo "# GPU check $(date -u +%FT%TZ)"
    echo
    grep -E "^installed [0-9]+ of|^  UNMET" "$OUT/log.txt" || echo "(no wheels installed)"
    echo
    echo "<!-- tests: ${STATUS[tests]:-not run} -->"
    tail -n 5 "$OUT/tests.txt" 2>/dev/null || echo "(no test output)"
    for name in blocks learner decode; do
        echo
        echo "<!-- $name: ${STATUS[$name]:-not run} -->"
        if [ -f "$OUT/$name.md" ]; then cat "$OUT/$name.md"; else echo "($name wrote no table; see log.txt)"; fi
    done
} > "$OUT/summary.md"
echo
echo "=== summary (total $(elapsed)s)"
for name in tests blocks learner decode; do echo "$name: ${STATUS[$name]:-not run}"; done
exit 0
