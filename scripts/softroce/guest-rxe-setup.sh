#!/bin/bash
# Guest side (root, inside the VM): load rdma_rxe and create SoftRoCE devices.
#   rxe0  on dummy0 (10.77.1.1, MTU $SR_MTU)         -> one "host", loopback RDMA
#   rxeP  on vP (10.77.2.1) <-veth-> vD (10.77.2.2) on rxeD   -> two devices, real wire
#         plus netns P (10.77.3.1) and D (10.77.3.2) joined by veth cP/cD for TCP.
# rxe in kernel 6.1 only works for netdevs in init_net, so the rxe pair lives in init_net
# with policy routing forcing 10.77.2.2<->10.77.2.1 over the veth instead of via lo.
set -e
SR_MTU=${SR_MTU:-9000}
ip link set lo up
modprobe rdma_rxe          # pulls ib_core, ib_uverbs, udp_tunnel, ip6_udp_tunnel
modprobe rdma_ucm          # /dev/infiniband/rdma_cm for librdmacm users (not auto-loaded: no udev)
modprobe dummy numdummies=0
modprobe veth
dmesg -n 1 || true         # keep kernel chatter off the serial console

ip link add dummy0 type dummy
ip link set dummy0 mtu "$SR_MTU"
ip addr add 10.77.1.1/24 dev dummy0
ip link set dummy0 up
rdma link add rxe0 type rxe netdev dummy0

if [ "${SR_TOPO:-pd}" = pd ]; then
  ip link add vP type veth peer name vD
  ip link set vP mtu "$SR_MTU"; ip link set vD mtu "$SR_MTU"
  ip addr add 10.77.2.1/24 dev vP; ip addr add 10.77.2.2/24 dev vD
  ip link set vP up; ip link set vD up
  for i in all vP vD; do sysctl -qw net.ipv4.conf.$i.accept_local=1 net.ipv4.conf.$i.rp_filter=0; done
  ip rule add pref 10 iif vP lookup local; ip rule add pref 11 iif vD lookup local
  ip route add 10.77.2.1 dev vD src 10.77.2.2 table 100
  ip route add 10.77.2.2 dev vP src 10.77.2.1 table 100
  ip rule add pref 20 lookup 100; ip rule add pref 30 lookup local; ip rule del pref 0
  rdma link add rxeP type rxe netdev vP
  rdma link add rxeD type rxe netdev vD
  ip netns add P; ip netns add D
  ip link add cP netns P type veth peer name cD netns D
  ip -n P addr add 10.77.3.1/24 dev cP; ip -n D addr add 10.77.3.2/24 dev cD
  for n in P D; do ip -n $n link set lo up; done
  ip -n P link set cP up; ip -n D link set cD up
fi
# GIDs appear asynchronously after the address is set: wait (5 s at most) until every
# device has its IPv4-mapped RoCE v2 GID (::ffff:a.b.c.d), whatever its index.
want="rxe0"; [ "${SR_TOPO:-pd}" = pd ] && want="rxe0 rxeP rxeD"
for i in $(seq 50); do
  ok=1
  for d in $want; do
    grep -qs '^0000:0000:0000:0000:0000:ffff:' /sys/class/infiniband/$d/ports/1/gids/* || ok=0
  done
  [ $ok = 1 ] && break
  sleep 0.1
done
set +e
