#!/bin/sh
# `make compose-check`: one line saying whether this machine's Compose reads the compose files.
# They need Docker Compose v2 (`docker compose`, 2.x): Debian's docker-compose 1.29 rejects their
# top-level `name` and `secrets.*.environment` with errors that do not say so. COMPOSE names the command.
compose=${COMPOSE:-docker compose}
version=$($compose version --short 2>/dev/null | tr -d '\r') || version=""
case "$version" in
  v[2-9].* | [2-9].* | v[1-9][0-9].* | [1-9][0-9].*)
    echo "$compose $version: ok (the compose files need Compose v2)"
    exit 0
    ;;
esac
echo "rankscope: the compose files need Docker Compose v2 ('docker compose' 2.x); '$compose' is ${version:-not installed} (docker-compose 1.x rejects their top-level name and secrets.*.environment)" >&2
exit 1
