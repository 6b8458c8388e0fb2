#!/bin/sh
# The restructuring's A/B (issue 21): see benchmarks/RESULTS.md, "Restructuring A/B".
# Two nodes on loopback, --insecure: one private daemon and one rank each.
P1=$(( 20000 + $$ % 10000 )); P2=$(( P1 + 1 ))
PEERS=tcp://127.0.0.1:$P1,tcp://127.0.0.1:$P2
for node in 0 1; do
  PORT=$(( P1 + node ))
  python -m gradsync.client.cli launch --nnodes 2 --node-rank $node --nproc-per-node 1 \
    --job ab --listen tcp://127.0.0.1:$PORT --peers $PEERS --insecure \
    --master-port $(( P1 + 100 )) "$(dirname "$0")/restructure_rank.py" "$@" &
done
wait
