#!/usr/bin/env bash
# Session 28: one suite invocation under a time limit, its folder packed into one file (the
# device returns at most 8 files).
#   LIMIT=540 bash suite.sh OUT NAME SUITE... [--correctness FILE]
set -u
OUT=$1 NAME=$2; shift 2
export PYTHONUNBUFFERED=1
timeout "${LIMIT:-540}" python -m recipes.bench.suite "$OUT/$NAME" "$@" 2>&1 | tee "$OUT/${NAME}_suite.log"
tar czf "$OUT/$NAME.tgz" -C "$OUT" "$NAME" && rm -rf "${OUT:?}/$NAME"
