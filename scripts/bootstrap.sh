#!/usr/bin/env bash
# Install idemrpc's build and test dependencies from Debian. Idempotent: packages
# already present are left alone, and nothing runs when all are there.
set -euo pipefail

PKGS=(build-essential meson ninja-build pkg-config cmake
      libnng-dev nng-utils libprotobuf-c-dev protobuf-c-compiler protobuf-compiler libssl-dev
      liblmdb-dev lmdb-utils zlib1g-dev libcriterion-dev libjansson-dev
      clang libclang-rt-dev curl openssl
      libpq-dev libhiredis-dev postgresql redis-server pgbouncer
      patroni etcd-server etcd-client nats-server libnats-dev
      libnghttp2-dev python3-grpcio # the gRPC front (-Dgrpc) and its tests' client
      prometheus) # tests/test_prometheus.sh: the dashboard and alerts (ops/)

missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

SUDO=
[ "$(id -u)" -eq 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
