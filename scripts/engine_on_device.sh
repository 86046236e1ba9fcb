#!/usr/bin/env bash
# `pagedkv generate --verify` for every native architecture (fp32 and bf16) and the lossless
# speculative-decoding checks, on one device; one JSON line per run in $OUT_DIR/engine.jsonl.
# Usage: DEVICE=cuda OUT_DIR=out scripts/engine_on_device.sh   (runs 4 at a time)
set -uo pipefail
DEVICE="${DEVICE:-cuda}"; OUT_DIR="${OUT_DIR:-.}"; JOBS="${JOBS:-4}"
mkdir -p "$OUT_DIR"
runs=()
for arch in llama-3-8b mistral-7b qwen3-8b gemma-3-27b gpt-oss-20b qwen3-next-80b nemotron-h-8b deepseek-v3; do
  for dtype in fp32 bf16; do
    runs+=("--tiny $arch --dtype $dtype --prompts 4 --prompt-len 24 --max-new-tokens 8")
  done
done
runs+=("--tiny deepseek-v3 --draft mtp --spec-tokens 3 --prompts 3 --max-new-tokens 8")
runs+=("--tiny deepseek-v3 --draft dspark --spec-tokens 3 --prompts 3 --max-new-tokens 8")
runs+=("--tiny llama-3-8b --draft eagle3 --spec-tokens 3 --prompts 3 --max-new-tokens 8")
runs+=("--tiny qwen3-next-80b --draft scripted --spec-tokens 3 --prompts 3 --max-new-tokens 8")
# prefix-cache hits: prompts of 64 tokens share their first 32 (two blocks of 16); a token
# budget of 80 admits one prefill per step, so later requests find the earlier ones' blocks
hits="--spec-tokens 3 --prompts 4 --prompt-len 64 --block-size 16 --max-batched-tokens 80 --max-new-tokens 8"
for pair in "deepseek-v3 mtp" "deepseek-v3 dspark" "llama-3-8b eagle3" "kimi-k3 dspark" "kimi-k3 scripted" "qwen3-next-80b scripted"; do
  set -- $pair
  runs+=("--tiny $1 --draft $2 $hits")
done
printf '%s\n' "${runs[@]}" | xargs -P "$JOBS" -I{} sh -c \
  "f=\$(mktemp -p '$OUT_DIR' run.XXXXXX); echo '{}' > \$f.args; python3 -m pagedkv generate {} --device $DEVICE --verify --json > \$f 2> \$f.err; true"
# one line per run: its JSON, or FAILED with its arguments and last stderr line
for f in "$OUT_DIR"/run.??????; do
  if [ -s "$f" ]; then tr -d '\n' < "$f"; else printf "FAILED %s: %s" "$(cat "$f.args")" "$(tail -1 "$f.err")"; fi; echo
done > "$OUT_DIR/engine.jsonl"
rm -f "$OUT_DIR"/run.*
python3 - "$OUT_DIR/engine.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        d = json.loads(line)
    except ValueError:
        print("FAILED:", line[:400]); continue
    print(d.get("architecture"), d.get("dtype"), d.get("draft", "-"), "match", d.get("match"),
          "max_abs_logit_diff %.3g" % d.get("max_abs_logit_diff", float("nan")),
          "lossless", d.get("lossless", "-"), "tokens", d.get("tokens_generated"),
          "prefix_hit_rate", d.get("prefix_hit_rate"), "acceptance_rate", d.get("acceptance_rate", "-"))
PY
