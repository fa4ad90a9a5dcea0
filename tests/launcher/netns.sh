#!/usr/bin/env bash
# Two "hosts" on one machine for the launcher tests: network namespaces dtorch-ID-a (SUBNET.2)
# and dtorch-ID-b (SUBNET.3), each wired by a veth pair to the bridge dtb-ID, which holds the
# controller side's address SUBNET.1. Needs root.
#
#   netns.sh up ID SUBNET   build them, e.g. `netns.sh up 4242 10.77.0`
#   netns.sh down ID        remove them; never fails, so it is safe in finalizers
#   netns.sh sweep          remove what runs that no longer exist left behind
#
# ID is the pid of the test run: concurrent runs (a developer's and CI's, or the whole suite
# and tests/launcher alone) get their own namespaces, and a run killed before its finalizer is
# recognised by its dead pid and swept away by the next one.
set -euo pipefail

down() {
    local id=$1
    for name in a b; do
        ip netns del "dtorch-$id-$name" 2>/dev/null || true
        ip link del "dtv$id$name" 2>/dev/null || true
    done
    ip link del "dtb-$id" 2>/dev/null || true
}

sweep() {
    local namespace id
    for namespace in $(ip netns list | awk '{print $1}'); do
        id=$(sed -n 's/^dtorch-\([0-9][0-9]*\)-[ab]$/\1/p' <<<"$namespace")
        if [ -n "$id" ] && [ ! -d "/proc/$id" ]; then
            down "$id"
        fi
    done
}

up() {
    local id=$1 subnet=$2 bridge="dtb-$1" name octet namespace
    down "$id"
    ip link add "$bridge" type bridge
    ip addr add "$subnet.1/24" dev "$bridge"
    ip link set "$bridge" up
    for side in a:2 b:3; do
        name=${side%%:*}
        octet=${side##*:}
        namespace="dtorch-$id-$name"
        ip netns add "$namespace"
        ip link add "dtv$id$name" type veth peer name eth0 netns "$namespace"
        ip link set "dtv$id$name" master "$bridge" up
        ip -n "$namespace" addr add "$subnet.$octet/24" dev eth0
        ip -n "$namespace" link set lo up
        ip -n "$namespace" link set eth0 up
    done
}

case "${1:-}" in
    up) up "$2" "$3" ;;
    down) down "$2" ;;
    sweep) sweep ;;
    *) echo "usage: $0 up ID SUBNET | down ID | sweep" >&2; exit 2 ;;
esac
