#!/usr/bin/env bash
# Container entrypoint: `docker run IMAGE [VERB] [hydra overrides...]`.
#
#   docker run IMAGE +profile=h100_fp8 model=llama3_1_8b server.port=8000   (VERB defaults to run)
#   docker run IMAGE plan +profile=h100_fp8
#   docker run IMAGE route router.instances=[http://a:8000,http://b:8000]   (a router over instances)
#   docker run IMAGE profiles
#
# Orchestrators that only set environment variables:
#   APPLIANCE_PROFILE=h100_fp8           same as +profile=h100_fp8 (an explicit +profile= argument wins)
#   APPLIANCE_OVERRIDES="model=x a.b=c"  overrides placed before the arguments (arguments win)
#   APPLIANCE_API_KEY=...                the API key (never in argv, where ps shows it)
# `run` listens on 0.0.0.0 unless server.host is given, and so refuses to start
# without a key unless server.allow_unauthenticated=true. The resolved config
# hash and the deployment fingerprint are printed before the verb runs.
set -euo pipefail

APPLIANCE=${APPLIANCE_BIN:-appliance}
VERBS="run route plan config profiles diff generate bench"

usage() {
  cat >&2 <<USAGE
usage: docker run IMAGE [VERB] [overrides...]
verbs: ${VERBS}
examples:
  docker run IMAGE +profile=h100_fp8 model=llama3_1_8b
  docker run IMAGE plan +profile=b200_fp8
  docker run IMAGE profiles
environment: APPLIANCE_PROFILE, APPLIANCE_OVERRIDES, APPLIANCE_API_KEY
USAGE
}

verb=run
if [[ $# -gt 0 && "$1" != *=* && "$1" != +* && "$1" != ~* && "$1" != -* ]]; then
  verb=$1
  shift
fi
case " ${VERBS} " in
  *" ${verb} "*) ;;
  *) echo "appliance-entrypoint: unknown verb '${verb}'" >&2; usage; exit 2 ;;
esac

args=()
if [[ "$verb" != profiles && "$verb" != diff && "$verb" != bench ]]; then
  has_profile=0
  has_host=0
  for a in "$@"; do
    [[ "$a" == +profile=* || "$a" == profile=* ]] && has_profile=1
    [[ "$a" == server.host=* || "$a" == router.host=* ]] && has_host=1
  done
  if [[ $has_profile == 0 && -n "${APPLIANCE_PROFILE:-}" ]]; then
    args+=("+profile=${APPLIANCE_PROFILE}")
  fi
  if [[ "$verb" == run && $has_host == 0 ]]; then
    args+=("server.host=0.0.0.0")
  fi
  if [[ "$verb" == route && $has_host == 0 ]]; then
    args+=("router.host=0.0.0.0")
  fi
  if [[ -n "${APPLIANCE_OVERRIDES:-}" ]]; then
    read -r -a env_overrides <<< "${APPLIANCE_OVERRIDES}"
    args+=("${env_overrides[@]}")
  fi
fi
args+=("$@")

if [[ "$verb" != profiles && "$verb" != diff && "$verb" != bench ]]; then
  # The config hash and deployment fingerprint, as /version reports them.
  if resolved=$($APPLIANCE config "${args[@]}"); then
    hash=$(printf '%s\n' "$resolved" | sed -n 's/^# config hash *//p')
    deployment=$(printf '%s\n' "$resolved" | sed -n 's/^# deployment *//p')
    echo "appliance-entrypoint: verb ${verb}, config hash ${hash}, deployment ${deployment}" >&2
  else
    exit 2
  fi
fi

if [[ -n "${APPLIANCE_DRY_RUN:-}" ]]; then
  printf '%s\n' "$APPLIANCE $verb ${args[*]}"
  exit 0
fi
# shellcheck disable=SC2086
exec $APPLIANCE "$verb" "${args[@]}"
