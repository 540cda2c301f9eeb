#!/usr/bin/env bash
# Corpus -> aligned, cleaned pairs -> train/valid/test -> joint sentencepiece -> fairseq binaries.
#
#   bash data/prepare.sh                          Ding German-English sentences (trans-de-en)
#   bash data/prepare.sh --files FILE.de FILE.en  two aligned files, one sentence a line
#   bash data/prepare.sh --tsv FILE               one "source<TAB>target" pair a line
#
# Writes under $WORK: corpus/, split/, spm/, pieces/, bin/ (what fairseq-train reads).
# shellcheck source=data/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

DING=/usr/share/trans/de-en
corpus=(ding "$DING")
case "${1:-}" in
  "") ;;
  --files) [[ $# -eq 3 ]] || die "usage: prepare.sh --files SOURCE_FILE TARGET_FILE"
           corpus=(files "$(realpath "$2")" "$(realpath "$3")") ;;
  --tsv) [[ $# -eq 2 ]] || die "usage: prepare.sh --tsv FILE"
         corpus=(tsv "$(realpath "$2")") ;;
  *) die "unknown option '$1'; usage: prepare.sh [--files SOURCE_FILE TARGET_FILE | --tsv FILE]" ;;
esac
need_command "$PYTHON"
need_command fairseq-preprocess

install_ding() {
  [[ -f "$DING" ]] && return
  [[ "$SRC-$TGT" == "de-en" || "$SRC-$TGT" == "en-de" ]] ||
    die "the default corpus is German-English; give --files or --tsv for $SRC-$TGT"
  log "$DING is missing: installing Debian's trans-de-en (the Ding dictionary, GPL-2+)"
  command -v apt-get >/dev/null || die "no apt-get here: install trans-de-en yourself or give --files/--tsv"
  local sudo=()
  ((EUID == 0)) || sudo=(sudo)
  "${sudo[@]}" apt-get install -y -q trans-de-en ||
    { "${sudo[@]}" apt-get update -q && "${sudo[@]}" apt-get install -y -q trans-de-en; } ||
    die "could not install trans-de-en; install it or give --files/--tsv"
  [[ -f "$DING" ]] || die "trans-de-en is installed but $DING is not there"
}

[[ "${corpus[0]}" == ding ]] && install_ding
for file in "${corpus[@]:1}"; do
  [[ -f "$file" ]] || die "corpus file $file not found"
done
# The work directory belongs to this corpus and these settings (the checksums catch edits).
checksums="$(sha256sum "${corpus[@]:1}" | cut -c1-16 | paste -sd,)"
claim "$WORK" "corpus=${corpus[0]}:$checksums langs=$SRC-$TGT \
clean=$CLEAN_MAX_CHARS,$CLEAN_MAX_RATIO valid=$VALID_SIZE test=$TEST_SIZE seed=$SPLIT_SEED \
spm=$SPM_VOCAB" "$WORK/done/corpus"

if begin_step corpus "$WORK/corpus"; then
  mkdir -p "$WORK/corpus"
  # Read (refusing what cannot be a corpus), clean, and write corpus/all.SRC/.TGT; the
  # cleaning log also goes to corpus/all.cleaning.log.
  clean=("$WORK/corpus/all" "$SRC" "$TGT" "$CLEAN_MAX_CHARS" "$CLEAN_MAX_RATIO")
  case "${corpus[0]}" in
    ding) "$PYTHON" "$DATA/extract_ding.py" "$DING" "$WORK/corpus/ding"
          "$PYTHON" "$DATA/corpus.py" files "$WORK/corpus/ding."{de,en} "${clean[@]}" ;;
    files) "$PYTHON" "$DATA/corpus.py" files "${corpus[1]}" "${corpus[2]}" "${clean[@]}" ;;
    tsv) "$PYTHON" "$DATA/corpus.py" tsv "${corpus[1]}" "${clean[@]}" ;;
  esac
  finish_step "$(count_lines "$WORK/corpus/all.$SRC") sentence pairs after cleaning"
fi

if begin_step split "$WORK/split"; then
  "$PYTHON" "$DATA/corpus.py" split "$WORK/corpus/all" "$SRC" "$TGT" "$WORK/split" \
    "$VALID_SIZE" "$TEST_SIZE" "$SPLIT_SEED"
  finish_step "$(for part in train valid test; do
    echo "$part $(count_lines "$WORK/split/$part.$SRC")"; done | paste -sd, | sed 's/,/, /g')"
fi

if begin_step sentencepiece "$WORK/spm"; then
  mkdir -p "$WORK/spm"
  "$PYTHON" "$DATA/spm.py" train "$WORK/spm/spm" "$SPM_VOCAB" \
    "$WORK/split/train.$SRC" "$WORK/split/train.$TGT"
  finish_step "joint model $WORK/spm/spm.model"
fi

if begin_step encode "$WORK/pieces"; then
  mkdir -p "$WORK/pieces"
  for part in train valid test; do
    for lang in "$SRC" "$TGT"; do
      "$PYTHON" "$DATA/spm.py" encode "$WORK/spm/spm.model" "$WORK/split/$part.$lang" \
        "$WORK/pieces/$part.$lang"
    done
  done
  finish_step "$(cat "$WORK"/pieces/train.* | wc -w | tr -d ' ') training pieces"
fi

if begin_step binarize "$WORK/bin"; then
  mkdir -p "$WORK/logs"
  fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" \
    --trainpref "$WORK/pieces/train" --validpref "$WORK/pieces/valid" \
    --testpref "$WORK/pieces/test" --destdir "$WORK/bin" --joined-dictionary --workers 2 \
    >"$WORK/logs/binarize.log" 2>&1 || die "fairseq-preprocess failed; see $WORK/logs/binarize.log"
  sed -n 's/.*preprocess:\(\[.*sents.*\)/  \1/p' "$WORK/logs/binarize.log"
  [[ -f "$WORK/bin/test.$SRC-$TGT.$TGT.bin" ]] || die "fairseq-preprocess wrote no test set"
  finish_step "joined dictionary of $(count_lines "$WORK/bin/dict.$SRC.txt") entries in $WORK/bin"
fi
