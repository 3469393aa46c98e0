#!/usr/bin/env bash
# What `make image-check` needs before it can build: podman (with runc) and, when no container registry answers,
# a local base image made from Debian's packages. Prints `BASE_IMAGE=<image>` as its last line.
#
# - podman, runc, mmdebstrap from the distribution's packages when missing (apt-get, as root; `apt-get update` once).
#   runc, not crun: crun refuses a mixed cgroup v1/v2 hierarchy (as on the development machine).
# - containers.conf in $CONTAINER_DIR: runc, and default ulimits no higher than this host's hard limits (podman's
#   default nofile of 1048576 fails where the hard limit is lower, e.g. 20000). The caller exports CONTAINERS_CONF.
# - iptables: netavark needs it to publish a port on 127.0.0.1.
# - The base: the Containerfile's published default (a pinned python:3.11 slim image) when a registry gives it;
#   otherwise Debian bookworm (Python 3.11) made with mmdebstrap, with the host's CA bundle so that pip and uv in
#   the build trust what the host trusts, imported as localhost/scorefn-base:bookworm-python3.11.
# Fails, saying why, where this machine cannot run containers: it never pretends.
set -euo pipefail
CONTAINER_DIR="${CONTAINER_DIR:?}"
PUBLISHED_BASE="${PUBLISHED_BASE:?}"
LOCAL_BASE="localhost/scorefn-base:bookworm-python3.11"
mkdir -p "$CONTAINER_DIR"

fail() { echo "image-check: this machine cannot build or run containers: $*" >&2; exit 1; }

missing=()
command -v podman >/dev/null || missing+=(podman)
command -v runc >/dev/null || missing+=(runc)
command -v iptables >/dev/null || missing+=(iptables)  # netavark sets up -p 127.0.0.1:PORT:8080 with it
if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null || fail "${missing[*]} missing and no apt-get to install them"
    [ "$(id -u)" = 0 ] || fail "${missing[*]} missing; installing them needs root (apt-get install ${missing[*]})"
    echo "image-check: installing ${missing[*]} from the distribution's packages" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
        uidmap slirp4netns fuse-overlayfs netavark aardvark-dns >&2 || \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 || \
        fail "apt-get could not install ${missing[*]}"
    apt_updated=1
fi

# nproc: at most 20000, though the hard limit here is higher (runc's setrlimit was refused at 96365 here).
nofile="$(ulimit -Hn)"; nproc="$(ulimit -Hu)"
[ "$nofile" = unlimited ] && nofile=1048576
{ [ "$nproc" = unlimited ] || [ "$nproc" -gt 20000 ]; } && nproc=20000
cat > "$CONTAINER_DIR/containers.conf" <<EOF
# Written by scripts/container-setup.sh for make image-check.
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF="$CONTAINER_DIR/containers.conf"
podman info >/dev/null 2>"$CONTAINER_DIR/podman-info.err" || fail "podman info failed: $(tail -3 "$CONTAINER_DIR/podman-info.err")"

# The published base if it is here or a registry gives it; else the local base made before; else make it.
if podman image exists "$PUBLISHED_BASE"; then
    echo "BASE_IMAGE=$PUBLISHED_BASE"
    exit 0
fi
if ! podman image exists "$LOCAL_BASE" && timeout 60 podman pull -q "$PUBLISHED_BASE" >/dev/null 2>&1; then
    echo "BASE_IMAGE=$PUBLISHED_BASE"
    exit 0
fi
if ! podman image exists "$LOCAL_BASE"; then
    echo "image-check: no registry gives $PUBLISHED_BASE; making $LOCAL_BASE with mmdebstrap" >&2
    if ! command -v mmdebstrap >/dev/null; then
        [ "$(id -u)" = 0 ] || fail "mmdebstrap missing; installing it needs root"
        [ -n "${apt_updated:-}" ] || apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >&2 \
            || fail "apt-get could not install mmdebstrap"
    fi
    tarball="$CONTAINER_DIR/base.tar"
    # minbase + Python 3.11 (bookworm's) and CA certificates, then the host's own bundle over Debian's;
    # /usr merged by mmdebstrap's hook rather than the usrmerge package (which pulls in perl: 48 MB);
    # no documentation, manual pages or translations (nothing in the image reads them).
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
        --customize-hook='upload /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        bookworm "$tarball" >"$CONTAINER_DIR/mmdebstrap.log" 2>&1 \
        || { tail -20 "$CONTAINER_DIR/mmdebstrap.log" >&2; fail "mmdebstrap could not make a base image"; }
    podman import --quiet --change 'CMD ["python3"]' "$tarball" "$LOCAL_BASE" >/dev/null
    rm -f "$tarball"
fi
echo "BASE_IMAGE=$LOCAL_BASE"
