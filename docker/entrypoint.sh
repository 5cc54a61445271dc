#!/usr/bin/env bash
# Container entrypoint: `docker run IMAGE [VERB] [hydra overrides...]`.
#
#   docker run IMAGE +profile=h100_fp8 model=llama3_1_8b server.port=8000   (VERB defaults to run)
#   docker run IMAGE plan +profile=h100_fp8
#   docker run IMAGE profiles
#
# Orchestrators that only set environment variables:
#   APPLIANCE_PROFILE=h100_fp8           same as +profile=h100_fp8 (an explicit +profile= argument wins)
#   APPLIANCE_OVERRIDES="model=x a.b=c"  overrides placed before the arguments (arguments win)
# `run` listens on 0.0.0.0 unless server.host is given. The resolved config
# hash is printed before the verb runs.
set -euo pipefail

APPLIANCE=${APPLIANCE_BIN:-appliance}
VERBS="run plan config profiles diff generate bench"

usage() {
  cat >&2 <<USAGE
usage: docker run IMAGE [VERB] [overrides...]
verbs: ${VERBS}
examples:
  docker run IMAGE +profile=h100_fp8 model=llama3_1_8b
  docker run IMAGE plan +profile=b200_fp8
  docker run IMAGE profiles
environment: APPLIANCE_PROFILE, APPLIANCE_OVERRIDES
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
    [[ "$a" == server.host=* ]] && has_host=1
  done
  if [[ $has_profile == 0 && -n "${APPLIANCE_PROFILE:-}" ]]; then
    args+=("+profile=${APPLIANCE_PROFILE}")
  fi
  if [[ "$verb" == run && $has_host == 0 ]]; then
    args+=("server.host=0.0.0.0")
  fi
  if [[ -n "${APPLIANCE_OVERRIDES:-}" ]]; then
    read -r -a env_overrides <<< "${APPLIANCE_OVERRIDES}"
    args+=("${env_overrides[@]}")
  fi
fi
args+=("$@")

if [[ "$verb" != profiles && "$verb" != diff && "$verb" != bench ]]; then
  # The hash of the canonical resolved YAML, as /v1/appliance/config reports it.
  if resolved=$($APPLIANCE config "${args[@]}"); then
    echo "appliance-entrypoint: verb ${verb}, config hash $(printf '%s\n' "$resolved" | sha256sum | cut -c1-16)" >&2
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
