#!/bin/sh
# kvrdma agent container entrypoint: resolves the vLLM-style kv_transfer_config and execs
# `kvrdma agent`, so the agent is PID 1 and gets the kubelet's SIGTERM directly.
#
# Arguments are passed to `kvrdma agent` as they are. With an explicit `--config` among them
# nothing else happens. Otherwise the config is, first match wins:
#   1. the file $KVRDMA_CONFIG_FILE (default /etc/kvrdma/kv_transfer_config.json), where the
#      Kubernetes manifests mount the role's ConfigMap;
#   2. the JSON in $KVRDMA_KV_TRANSFER_CONFIG;
# and anything else is an error (exit 2) that says what was looked for.
#
# Environment:
#   KVRDMA_ENGINE_ID         engine_id for a config that has none. The manifests set it to the
#                            pod name, so every replica of a Deployment has its own engine id
#                            while sharing one ConfigMap.
#   KVRDMA_EFFECTIVE_CONFIG  where to write the config as the agent uses it (engine_id
#                            included). The manifests point it into the volume shared with the
#                            engine container, whose `--kv-transfer-config` reads it, so agent
#                            and engine agree on the engine id by construction.
#   KVRDMA_LOG_LEVEL         DEBUG, INFO, WARNING (default), ERROR or CRITICAL (or WARN, FATAL).
#   VLLM_NIXL_SIDE_CHANNEL_HOST / VLLM_NIXL_SIDE_CHANNEL_PORT are read by `kvrdma agent`.
#   KVRDMA_METRICS_PORT      the base port the engine's ranks serve /metrics on (127.0.0.1,
#                            base + TP rank; the manifests set it on both containers).
#                            `kvrdma agent` merges those --expected-ranks endpoints into its
#                            own /metrics; KVRDMA_WORKER_METRICS (URL[,URL...]) or
#                            --worker-metrics name the endpoints explicitly instead. The
#                            environment passes through the exec below unchanged.
#
# A first argument that is not an option runs that command instead (`... image sh`).
set -eu

log_level="${KVRDMA_LOG_LEVEL:-WARNING}"

if [ "$#" -gt 0 ]; then
    case "$1" in
        -*) ;;
        *) exec "$@" ;;
    esac
fi

# checked here, since kvrdma's own error could name only its --log-level flag
case "$(printf '%s' "$log_level" | tr '[:lower:]' '[:upper:]')" in
    DEBUG | INFO | WARNING | WARN | ERROR | CRITICAL | FATAL) ;;
    *)
        echo "kvrdma-agent-entrypoint: KVRDMA_LOG_LEVEL: expected DEBUG, INFO, WARNING," \
            "ERROR or CRITICAL (any case), got '$log_level'" >&2
        exit 2
        ;;
esac

for arg in "$@"; do
    case "$arg" in
        --config | --config=*) exec kvrdma --log-level "$log_level" agent "$@" ;;
    esac
done

config_file="${KVRDMA_CONFIG_FILE:-/etc/kvrdma/kv_transfer_config.json}"
if [ -f "$config_file" ]; then
    if [ ! -r "$config_file" ]; then
        echo "kvrdma-agent-entrypoint: $config_file exists but uid $(id -u) cannot read it" >&2
        exit 2
    fi
    source_kind="file"
    source="$config_file"
elif [ -n "${KVRDMA_KV_TRANSFER_CONFIG:-}" ]; then
    source_kind="env"
    source="$KVRDMA_KV_TRANSFER_CONFIG"
else
    echo "kvrdma-agent-entrypoint: no kv_transfer_config: pass --config PATH_OR_JSON, mount" \
        "a file at $config_file (or set KVRDMA_CONFIG_FILE), or set KVRDMA_KV_TRANSFER_CONFIG" >&2
    exit 2
fi

# The effective config: the source with engine_id filled in from KVRDMA_ENGINE_ID. Bad JSON
# is passed through unchanged, so that `kvrdma agent` reports it with line and column.
effective="$(python3 - "$source_kind" "$source" <<'PY'
import json
import os
import sys

kind, source = sys.argv[1], sys.argv[2]
text = open(source, encoding="utf-8").read() if kind == "file" else source
engine_id = os.environ.get("KVRDMA_ENGINE_ID", "").strip()
try:
    config = json.loads(text)
except ValueError:
    config = None
if isinstance(config, dict) and engine_id:
    if config.get("engine_id") in (None, ""):
        config["engine_id"] = engine_id
    elif config["engine_id"] != engine_id:
        print(
            f"kvrdma-agent-entrypoint: the config's engine_id {config['engine_id']!r} wins over "
            f"KVRDMA_ENGINE_ID={engine_id!r}; replicas sharing this config share that id",
            file=sys.stderr,
        )
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
sys.stdout.write(text)
PY
)"

if [ -n "${KVRDMA_EFFECTIVE_CONFIG:-}" ]; then
    # write-then-rename, so a reader never sees half a file
    tmp="$KVRDMA_EFFECTIVE_CONFIG.tmp.$$"
    printf '%s\n' "$effective" > "$tmp"
    chmod 0644 "$tmp"
    mv -f "$tmp" "$KVRDMA_EFFECTIVE_CONFIG"
    exec kvrdma --log-level "$log_level" agent --config "$KVRDMA_EFFECTIVE_CONFIG" "$@"
fi
exec kvrdma --log-level "$log_level" agent --config "$effective" "$@"
