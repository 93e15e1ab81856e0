#!/usr/bin/env bash
# The Secrets the recipe mounts, made with `kvpush keys`: a CurveZMQ key pair per engine
# (named after its engine_id), the allow-list of every engine's public key, and the params
# key the router signs kv_transfer_params with. Keys are written to a private directory
# ($KVPUSH_KEYS_DIR, default ./kvpush-keys), then applied as Secrets in namespace kvpush.
# KVPUSH_DRY_RUN=1 ./make-secrets.sh makes the keys and prints the kubectl commands only.
set -euo pipefail
dir=${KVPUSH_KEYS_DIR:-./kvpush-keys}
ns=${KVPUSH_NAMESPACE:-kvpush}
umask 077
mkdir -p "$dir"
for engine in prefill-0 decode-0; do  # kept when run again (rotate: remove the files first)
  [ -s "$dir/$engine.key_secret" ] || kvpush keys generate "$engine" --dir "$dir"
done
# Not NAME.key: that suffix marks a public certificate of the allow-list.
[ -s "$dir/params-key.hex" ] || openssl rand -hex 32 > "$dir/params-key.hex"
kvpush keys check --key-file "$dir/prefill-0.key_secret" --allowed "$dir"
apply() {
  if [ -n "${KVPUSH_DRY_RUN:-}" ]; then
    echo "kubectl -n $ns create secret generic $*"
  else
    kubectl -n "$ns" create secret generic "$@" --dry-run=client -o yaml | kubectl apply -f -
  fi
}
[ -n "${KVPUSH_DRY_RUN:-}" ] || kubectl get namespace "$ns" >/dev/null 2>&1 \
  || kubectl create namespace "$ns"
apply kvpush-prefill-key --from-file=engine.key_secret="$dir/prefill-0.key_secret"
apply kvpush-decode-key --from-file=engine.key_secret="$dir/decode-0.key_secret"
apply kvpush-allowed --from-file="$dir/prefill-0.key" --from-file="$dir/decode-0.key"
apply kvpush-params --from-file=params.key="$dir/params-key.hex"
echo "make-secrets: 4 Secrets in namespace $ns (keys kept in $dir: keep it private)"
