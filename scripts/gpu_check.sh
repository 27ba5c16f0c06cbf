#!/usr/bin/env bash
# Every CUDA path in one go, for a lent GPU machine that has PyTorch but no package index:
#   bash scripts/gpu_check.sh STAGE...     stages: env gputests precisions train ddp translate oom bench suite
#                                           search evaluate matrix onmt
# Reads Multi30k from $MULTI30K_DIR (default .gpu/multi30k), pure-Python dependencies the machine lacks
# (hydra, omegaconf, antlr4, sacremoses, py3langid) from .gpu/site, a CPU-trained checkpoint and its CPU
# fp32 hypotheses from .gpu/ (translate and bench only; see docs/development.md, "On a GPU"). Full logs go
# to $OUT (or /tmp/gpu_out), one summary line per finding to stdout. `search` runs the training runs listed
# in $SEARCH (default docs/lab/gpu_search.txt) side by side until $SEARCH_SECONDS (default 300) have passed;
# SEARCH_RESUME=1 continues them from their last.pt in a later call while the machine is still warm.
# `matrix` times the trainer's step by model, precision, compile and batch budget within $MATRIX_SECONDS (default:
# what is left of $CALL_SECONDS less 45 s, else 420; scripts/gpu_matrix.py, MATRIX_ARGS for more of its
# options) and writes docs/gpu/<date>-<device>.json and the same file in $OUT; `onmt` adds OpenNMT-py 3.5.1's rows
# to it, installed from .gpu/wheels (scripts/gpu_wheels.sh), at $ONMT_TOKENS (default 32768; a list: a row each)
# target tokens for $ONMT_STEPS (default 200) steps, at most $ONMT_SECONDS (default 120) each. The checklist's call:
#   CALL_SECONDS=575 bash scripts/gpu_check.sh onmt matrix
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/.gpu/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 GPU_CHECK_RUN=$$
export MULTI30K_DIR=${MULTI30K_DIR:-$ROOT/.gpu/multi30k}
PY=${PY:-python3}
M=$MULTI30K_DIR
RUNS=/tmp/gpu_runs
CACHE=/tmp/gpu_cache
LOG="$OUT/gpu.log"
say() { echo "== $*" | tee -a "$LOG"; }
DATA="data=multi30k_de_en data.path=$M data.cache_dir=$CACHE"

stage_env() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee -a "$LOG"
    $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'bf16', torch.cuda.is_bf16_supported())" 2>&1 | tee -a "$LOG"
    $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$LOG" 2>&1 \
        && say "env: package installed (entry points)" || say "env: pip install -e . failed (modules still run with python -m)"
    $PY -c "import transformer.train, transformer.cli.translate, hydra, sacrebleu, sentencepiece, tensorboard; print('imports ok')" 2>&1 | tee -a "$LOG"
}

stage_gputests() {
    # output to a file, not a pipe: a child left behind would hold a pipe open; SIGABRT makes a hung
    # pytest print every thread's stack (PYTHONFAULTHANDLER)
    PYTHONFAULTHANDLER=1 timeout -s ABRT 150 $PY -m pytest -q -m gpu tests -p no:cacheprovider >"$OUT/gputests.log" 2>&1
    say "gpu tests: rc $?"
    tail -5 "$OUT/gputests.log"
    leftovers
}

leftovers() {   # processes this script started that outlived their stage (found by a marker in their
                # environment, so nothing else on the machine is touched), with their Python stacks
    local left="" pid
    for pid in $(grep -lzx "GPU_CHECK_RUN=$$" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3); do
        # still alive: the processes of the $(...) above carry the marker too, and are gone by now
        [ "$pid" != "$$" ] && [ "$pid" != "$BASHPID" ] && [ -d /proc/$pid ] && left="$left $pid"
    done
    [ -z "$left" ] && return
    say "left running:$left"
    ps -o pid,ppid,etime,args -p "$(echo $left | tr ' ' ,)" | cut -c 1-200 | tee -a "$LOG"
    kill -ABRT $left 2>/dev/null; sleep 2; kill -9 $left 2>/dev/null
}

train_run() {   # name, overrides...: one model=base run on the GPU, then the key lines of its log
    local name=$1; shift
    local t0=$SECONDS
    PYTHONFAULTHANDLER=1 timeout -s ABRT 150 $PY -m transformer.train $DATA model=base trainer.device=cuda \
        hydra.run.dir=$RUNS/$name "$@" >"$OUT/$name.out" 2>&1
    local rc=$?
    say "train $name: rc $rc, $((SECONDS - t0)) s"
    cat "$OUT/$name.out" >>"$LOG"
    grep -E "device cuda|step (50|150|300) \||reached|validation step|test_2016|BLEU|Error|error" "$RUNS/$name/train.log" 2>/dev/null \
        | cut -c 27-260 | tail -12
    leftovers
}

stage_precisions() {   # 20 s of training at each precision (the preset's 2,048-token batches)
    local p
    for p in fp32 bf16 fp16; do
        train_run base-$p trainer.precision=$p trainer.max_minutes=${PRECISION_MINUTES:-0.33} trainer.test_at_end=false \
            trainer.attention_heatmaps=off
    done
    rm -f "$OUT"/base-*.out
}

list_runs() {   # the run lines of a search list (`name | overrides`), comments left out
    grep -v "^#" "$1" | grep "|"
}

list_common() {   # the overrides of its `common:` line
    grep -m1 "^common:" "$1" | cut -d: -f2-
}

stage_search() {   # the runs of $SEARCH side by side: one GPU, one host core each
    local list=${SEARCH:-docs/lab/gpu_search.txt} seconds=${SEARCH_SECONDS:-300} pids=() names=() name args i
    local common data
    common=$(list_common "$list")
    for data in $(grep -v "^#" "$list" | grep -o "data=[a-z0-9_]*" | sort -u); do   # each corpus once, before the runs
        # shellcheck disable=SC2086
        $PY -m transformer.cli.prepare $common $data data.path=$M data.cache_dir=$CACHE >>"$LOG" 2>&1
    done
    say "search: $(list_runs "$list" | wc -l) runs of '$common' for $seconds s"
    while IFS='|' read -r name args; do
        name=$(echo $name)
        # the defaults first: the list's overrides come later and win (trainer.test_at_end=true, say)
        # shellcheck disable=SC2086
        OMP_NUM_THREADS=1 timeout -s TERM "$seconds" $PY -m transformer.train data.path=$M data.cache_dir=$CACHE \
            trainer.device=cuda trainer.max_minutes=0 trainer.test_at_end=false trainer.attention_heatmaps=off \
            trainer.num_workers=1 trainer.num_threads=1 $common $args ${SEARCH_RESUME:+trainer.resume=true} \
            hydra.run.dir=$RUNS/search/$name >>"$OUT/search-$name.out" 2>&1 &
        pids+=($!) names+=("$name")
    done < <(list_runs "$list")
    for i in "${!pids[@]}"; do   # 0: finished, 124: stopped by the time limit (last.pt written); else the end of its output
        wait "${pids[$i]}" || [ $? = 124 ] || { echo "--- ${names[$i]} failed:"; tail -6 "$OUT/search-${names[$i]}.out"; } \
            | tee -a "$LOG"
    done
    for name in $(ls $RUNS/search); do   # step, validation BLEU raw and EMA, EMA validation loss
        [ -f $RUNS/search/$name/train.log ] || continue
        echo "--- $name: $(grep -E 'step +[0-9]+ \|' $RUNS/search/$name/train.log | tail -1 | cut -c 53-130)"
        grep -E "test_2016|test \|" $RUNS/search/$name/train.log | cut -c 53-200 | tail -2
        # a multilingual run: the mean of its directions
        grep "validation step" $RUNS/search/$name/train.log | grep -v -E "validation step [0-9]+ [a-z]+-[a-z]+ " \
            | sed -E 's/ mean of [0-9]+ directions//' \
            | sed -E 's/.*validation step ([0-9]+)( \((ema) weights\))? \| loss ([0-9.]+) .*BLEU ([0-9.]+).*/\1 \3 \4 \5/' \
            | awk '{ if ($2 == "ema") { e[$1] = $4; l[$1] = $3 } else if (NF == 3) { r[$1] = $3; s[$1] = 1 } }
                   END { for (k in s) printf "%6d raw %6s ema %6s ema loss %s\n", k, r[k], e[k], l[k] }' | sort -n | tail -6
    done | tee "$OUT/search.txt"
    (cd $RUNS && tar czf "$OUT/search_logs.tgz" search/*/train.log search/*/.hydra)
    rm -f "$OUT"/search-*.out   # at most 8 files come back from a call
}

stage_evaluate() {   # the search runs' best.pt on test_2016_flickr, beam 5, side by side: cased detokenized and
                    # tokenized lowercased BLEU (the references in $M/tok), for the direction named by the run's data
                    # preset (multi30k_de_en: de-en), or each of the six of data=multi30k_multi, one after another
    local list=${SEARCH:-docs/lab/gpu_search.txt} name args data directions pids=()
    while IFS='|' read -r name args; do
        name=$(echo $name)
        data=$(echo "$(list_common "$list") $args" | grep -o "data=multi30k_[a-z_]*" | tail -1 | cut -c 15-)
        case $data in
            multi) directions="de-en fr-en cs-en en-de en-fr en-cs" ;;
            ?*) directions=${data/_/-} ;;
            *) echo "--- $name: no data=multi30k_... preset in its line or common:, nothing to score"; continue ;;
        esac
        [ -f $RUNS/search/$name/checkpoints/best.pt ] || { echo "--- $name: no best.pt"; continue; }
        (for direction in $directions; do
            local langs=()
            [ "$data" = multi ] && langs=(--src-lang "${direction%-*}" --tgt-lang "${direction#*-}")
            OMP_NUM_THREADS=1 $PY -m transformer.cli.evaluate $RUNS/search/$name/checkpoints/best.pt --device ${EVAL_DEVICE:-cuda} \
                --beam 5 "${langs[@]}" --tokenized-lc "$M/tok/test_2016_flickr.lc.norm.tok.${direction#*-}" 2>&1
        done) >"$OUT/eval-$name.out" &
        pids+=($!)
    done < <(list_runs "$list")
    wait "${pids[@]}"
    rm -f "$OUT/evaluate.txt"
    for f in "$OUT"/eval-*.out; do
        echo "--- $(basename "$f" .out)"
        grep -E "^test|tokenized|off-target|error" "$f" | sed -E 's/ *nrefs.*//; s/\(not comparable with the above\)//' | cut -c 1-160
    done | tee -a "$LOG" "$OUT/evaluate.txt"
    rm -f "$OUT"/eval-*.out
}

stage_train() {   # 300 steps of 8k-token batches, then the test set
    local short="trainer.max_tokens=8192 trainer.max_steps=300 trainer.validate_every=150 trainer.checkpoint_every=150
                 trainer.log_every=50 trainer.test_at_end=true"
    # shellcheck disable=SC2086
    train_run bf16 $short trainer.precision=bf16
    # shellcheck disable=SC2086
    train_run fp16 $short trainer.precision=fp16
    # shellcheck disable=SC2086
    TORCH_LOGS=recompiles train_run compiled $short trainer.precision=bf16 trainer.compile=true
    say "compiled: $(grep -c -i 'recompiling' "$OUT/compiled.out") recompiles logged; step of each:"
    grep -i -B1 "recompiling" "$OUT/compiled.out" | head -20 | tee -a "$LOG"
    tail -c 3000 "$OUT/compiled.out" >>"$LOG"
    rm -f "$OUT"/{bf16,fp16,compiled}.out
}

stage_ddp() {
    local common="$DATA model=base trainer.device=cuda trainer.max_tokens=8192 trainer.validate_every=100 \
        trainer.log_every=50 trainer.test_at_end=false hydra.run.dir=$RUNS/ddp"
    $PY -m torch.distributed.run --standalone --nproc_per_node=1 -m transformer.train $common trainer.max_steps=200 \
        >>"$LOG" 2>&1
    say "ddp first part: rc $?"
    $PY -m torch.distributed.run --standalone --nproc_per_node=1 -m transformer.train $common trainer.max_steps=300 \
        trainer.resume=true >>"$LOG" 2>&1
    say "ddp resumed: rc $?"
    grep -E "world size|resum|start:|step (200|250|300) \||nccl|NCCL" $RUNS/ddp/train.log | cut -c 27-220 | tee -a "$LOG"
}

stage_translate() {
    $PY - <<'EOF' 2>&1 | tee -a "$LOG"
import os, time, sacrebleu, torch
from transformer.inference.translator import Translator
m = os.environ["MULTI30K_DIR"]
src = open(f"{m}/test_2016_flickr.de").read().splitlines()
ref = open(f"{m}/test_2016_flickr.en").read().splitlines()
cpu = {b: open(f".gpu/cpu_fp32_{b}.hyp").read().splitlines() for b in ("beam5", "greedy")}
for precision in ("fp32", "bf16", "fp16"):
    t = Translator.from_checkpoint(".gpu/deen-s1.pt", device="cuda", precision=precision)
    for name, beam in (("beam5", 5), ("greedy", 1)):
        t.translate(src[:200], beam_size=beam)                     # warm-up
        torch.cuda.synchronize(); start = time.perf_counter()
        hyp = t.translate(src, beam_size=beam)
        torch.cuda.synchronize(); seconds = time.perf_counter() - start
        same = sum(a == b for a, b in zip(hyp, cpu[name]))
        bleu = sacrebleu.corpus_bleu(hyp, [ref]).score
        cpu_bleu = sacrebleu.corpus_bleu(cpu[name], [ref]).score
        print(f"translate cuda {precision} {name}: {len(src) / seconds:.0f} sentences/s ({seconds:.2f} s), "
              f"same as CPU fp32 on {same}/{len(src)}, BLEU {bleu:.2f} (CPU fp32 {cpu_bleu:.2f})")
EOF
    # the CLI as users run it
    local t0=$SECONDS
    $PY -m transformer.cli.translate .gpu/deen-s1.pt --device cuda --beam 5 <"$M/test_2016_flickr.de" >/tmp/cli.hyp 2>>"$LOG"
    say "translate CLI --device cuda: rc $?, $((SECONDS - t0)) s whole process, $(wc -l </tmp/cli.hyp) lines"
}

stage_oom() {
    # a training max_tokens far too large for the GPU: one line, rc 2
    $PY -m transformer.train $DATA model=big trainer.device=cuda trainer.max_tokens=2000000 data.max_len=128 \
        trainer.max_steps=20 trainer.test_at_end=false hydra.run.dir=$RUNS/oom >"$OUT/oom.out" 2>&1
    say "train max_tokens=2000000 model=big: rc $? ; last lines:"
    tail -4 "$OUT/oom.out" | cut -c 1-400 | tee -a "$LOG"
    rm -f "$OUT/oom.out"
}

stage_bench() {
    for preset in base big; do
        $PY scripts/bench.py --device cuda --preset $preset --max-tokens 8192 --compile --data-scale 0 \
            --checkpoint .gpu/deen-s1.pt --cli-repeats 0 --repeats 3 --steps 20 --trainer-steps 50 --output "$OUT/bench-$preset.json" >>"$LOG" 2>&1
        say "bench $preset: rc $?"
        tail -25 "$LOG" | grep -E "mfu|MFU|tok/s|sent|peak|train|decode" | head -20
    done
}

stage_matrix() {   # the table and the JSON of scripts/gpu_matrix.py; output to files, not a pipe (see gputests)
    # its time: MATRIX_SECONDS, else what is left of CALL_SECONDS (this call's, counted from the script's start)
    # less 45 s for a row that outruns its estimate, else 420 s
    local seconds=${MATRIX_SECONDS:-420}
    [ -z "${MATRIX_SECONDS:-}" ] && [ -n "${CALL_SECONDS:-}" ] && seconds=$((CALL_SECONDS - SECONDS - 45))
    [ "$seconds" -lt 120 ] && seconds=120   # the first rows at least (each is written as it ends)
    local t0=$SECONDS
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv >>"$LOG" 2>&1
    # the matrix stops starting rows at $seconds; a row begun just before may run on for its own time
    # shellcheck disable=SC2086
    PYTHONFAULTHANDLER=1 timeout -s ABRT $((seconds + 150)) $PY scripts/gpu_matrix.py matrix --data-dir "$M" \
        --cache-dir $CACHE --out "$OUT" --seconds "$seconds" ${MATRIX_ARGS:-} >"$OUT/matrix.log" 2>&1
    say "matrix: rc $?, $((SECONDS - t0)) s"
    if [ -f "$OUT/matrix.txt" ]; then tee -a "$LOG" <"$OUT/matrix.txt"; else tail -20 "$OUT/matrix.log"; fi
    leftovers
}

stage_onmt() {   # OpenNMT-py 3.5.1 on model=base's shape, same data and GPU (scripts/gpu_onmt.py): rows of the JSON
    local work=/tmp/gpu_onmt device=${ONMT_DEVICE:-cuda} tokens wheels rc t0 log="$OUT/onmt.log"
    mkdir -p $work/stubs/spacy
    # imported at start by transforms this run does not use (terminology, clean): empty stand-ins let it start
    : >$work/stubs/spacy/__init__.py
    : >$work/stubs/fasttext.py
    wheels=$($PY scripts/gpu_onmt.py wheels "${ONMT_WHEELS:-.gpu/wheels}") \
        || { say "onmt: no wheels (bash scripts/gpu_wheels.sh)"; return; }
    # shellcheck disable=SC2086
    $PY -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --upgrade --target $work/site $wheels \
        >>"$log" 2>&1 || { say "onmt: pip install failed"; tail -5 "$log"; return; }
    say "onmt: installed $(echo $wheels | wc -w) wheels"
    local pypath="$work/site:$work/stubs:$PYTHONPATH"
    PYTHONPATH=$pypath $PY scripts/gpu_onmt.py prepare --data-dir "$M" --work $work >>"$log" 2>&1 \
        || { say "onmt: prepare failed"; tail -5 "$log"; return; }
    for tokens in ${ONMT_TOKENS:-32768}; do
        PYTHONPATH=$pypath $PY scripts/gpu_onmt.py config --work $work --tokens "$tokens" --device "$device" \
            --steps "${ONMT_STEPS:-200}" --report-every "${ONMT_REPORT:-20}" --model "${ONMT_MODEL:-base}" \
            >>"$log" 2>&1 || { say "onmt: config failed"; tail -5 "$log"; return; }
        [ -f $work/vocab.shared ] || PYTHONPATH=$pypath $PY -m onmt.bin.build_vocab \
            -config $work/${ONMT_MODEL:-base}-$tokens.yaml -n_sample -1 >>"$log" 2>&1
        t0=$SECONDS
        PYTHONPATH=$pypath timeout -s TERM "${ONMT_SECONDS:-120}" $PY -m onmt.bin.train \
            -config $work/${ONMT_MODEL:-base}-$tokens.yaml >$work/train-$tokens.log 2>&1
        rc=$?
        cat $work/train-$tokens.log >>"$log"
        PYTHONPATH=$pypath $PY scripts/gpu_onmt.py row --log $work/train-$tokens.log --rc $rc --tokens "$tokens" \
            --skip "${ONMT_SKIP:-60}" --seconds $((SECONDS - t0)) --device "$device" --model "${ONMT_MODEL:-base}" \
            --out "$OUT" ${ONMT_JSON_DIR:+--json-dir "$ONMT_JSON_DIR"} 2>>"$log" | tee -a "$LOG"
        leftovers
    done
}

stage_suite() {
    timeout 540 $PY -m pytest -q tests -p no:cacheprovider --ignore=tests/test_install.py 2>&1 \
        | tee "$OUT/suite.log" | tail -20
}

for stage in "$@"; do
    say "stage $stage ($(date +%T))"
    "stage_$stage"
done
say "done ($(date +%T))"
