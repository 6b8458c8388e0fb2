#!/bin/sh
# Per-job CURVE keys for train-job.yaml: one keypair per pod, recording the pod's
# peer endpoint, in the Secret gradsync-train-keys. Run once per job, then delete
# the Secret with the job (kubectl delete secret gradsync-train-keys).
set -eu
PODS=${1:-2}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
i=0
while [ "$i" -lt "$PODS" ]; do
    gradsync keygen "$DIR" --name "train-$i" --endpoint "tcp://train-$i.train:29400"
    i=$((i + 1))
done
kubectl create secret generic gradsync-train-keys --from-file="$DIR"
