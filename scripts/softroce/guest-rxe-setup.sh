#!/bin/bash
# Guest side (root, inside the VM): load rdma_rxe and create SoftRoCE devices.
#   SR_TOPO=pd (default):
#     rxeP on vP (10.77.2.1) <-veth-> vD (10.77.2.2) on rxeD   -> two devices, real wire
#   SR_TOPO=full: also rxe0 on dummy0 (10.77.1.1, one "host", loopback RDMA) and netns P
#     (10.77.3.1) / D (10.77.3.2) joined by veth cP/cD for TCP.
# MTU $SR_MTU (default 9000 -> rxe active_mtu 4096).
# rxe in kernel 6.1 only works for netdevs in init_net, so the rxe pair lives in init_net
# with policy routing forcing 10.77.2.2<->10.77.2.1 over the veth instead of via lo.
# Under TCG every fork+exec costs ~0.3-1 s, so the commands go through `ip -batch` and
# /proc writes instead of one process each.
set -e
SR_MTU=${SR_MTU:-9000}
SR_TOPO=${SR_TOPO:-pd}
modprobe -a rdma_rxe veth      # rdma_rxe pulls ib_core, ib_uverbs, udp_tunnel
for f in all/accept_local; do echo 1 > /proc/sys/net/ipv4/conf/$f; done
echo 0 > /proc/sys/net/ipv4/conf/all/rp_filter
ip -batch - <<IP
link set lo up
link add vP type veth peer name vD
link set vP mtu $SR_MTU
link set vD mtu $SR_MTU
addr add 10.77.2.1/24 dev vP
addr add 10.77.2.2/24 dev vD
link set vP up
link set vD up
rule add pref 10 iif vP lookup local
rule add pref 11 iif vD lookup local
route add 10.77.2.1 dev vD src 10.77.2.2 table 100
route add 10.77.2.2 dev vP src 10.77.2.1 table 100
rule add pref 20 lookup 100
rule add pref 30 lookup local
rule del pref 0
IP
for i in vP vD; do
  echo 1 > /proc/sys/net/ipv4/conf/$i/accept_local; echo 0 > /proc/sys/net/ipv4/conf/$i/rp_filter
done
rdma link add rxeP type rxe netdev vP
rdma link add rxeD type rxe netdev vD
want="rxeP rxeD"
if [ "$SR_TOPO" = full ]; then
  modprobe -a rdma_ucm dummy   # rdma_ucm: /dev/infiniband/rdma_cm (no udev to load it)
  ip link add dummy0 type dummy
  ip link set dummy0 mtu "$SR_MTU"
  ip addr add 10.77.1.1/24 dev dummy0
  ip link set dummy0 up
  rdma link add rxe0 type rxe netdev dummy0
  ip netns add P; ip netns add D
  ip link add cP netns P type veth peer name cD netns D
  ip -n P addr add 10.77.3.1/24 dev cP; ip -n D addr add 10.77.3.2/24 dev cD
  for n in P D; do ip -n $n link set lo up; done
  ip -n P link set cP up; ip -n D link set cD up
  want="$want rxe0"
fi
# GIDs appear asynchronously after the address is set: wait (5 s at most) until every
# device has its IPv4-mapped RoCE v2 GID (::ffff:a.b.c.d; index 1 on rxe, but the code
# looks it up by type and address).
for _ in $(seq 50); do
  ok=1
  for d in $want; do
    read -r g < /sys/class/infiniband/$d/ports/1/gids/1 || g=
    case $g in 0000:0000:0000:0000:0000:ffff:*) ;; *) ok=0 ;; esac
  done
  [ $ok = 1 ] && break
  sleep 0.1
done
set +e
