//! The default of `--allowed-prefill-hosts`: loopback and the networks this host's
//! interfaces are directly attached to (read from Linux's `/proc/net/route` and
//! `/proc/net/if_inet6`), so that a D connects by default only to P agents in its own
//! deployment's networks, never to an arbitrary address a request's `remote_host` names.

use super::Cidr;

/// Loopback and the directly attached networks of this host's interfaces. Where the
/// interface tables cannot be read (not Linux), loopback only.
#[must_use]
pub fn local_networks() -> Vec<Cidr> {
    let mut nets = vec![
        Cidr::new(std::net::Ipv4Addr::LOCALHOST.into(), 8),
        Cidr::new(std::net::Ipv6Addr::LOCALHOST.into(), 128),
    ];
    match std::fs::read_to_string("/proc/net/route") {
        Ok(t) => nets.extend(ipv4_routes(&t)),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read /proc/net/route; the default --allowed-prefill-hosts is loopback only for IPv4")
        }
    }
    if let Ok(t) = std::fs::read_to_string("/proc/net/if_inet6") {
        nets.extend(ipv6_addresses(&t));
    }
    let mut seen = std::collections::HashSet::new();
    nets.retain(|n| seen.insert(*n));
    nets
}

/// The directly attached IPv4 networks of `/proc/net/route` (no gateway, up, not the
/// default route).
fn ipv4_routes(text: &str) -> Vec<Cidr> {
    const RTF_UP: u32 = 0x1;
    let hex = |s: &str| u32::from_str_radix(s, 16).ok();
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (dest, gateway, flags, mask) = (
                hex(f.get(1)?)?,
                hex(f.get(2)?)?,
                hex(f.get(3)?)?,
                hex(f.get(7)?)?,
            );
            // The kernel prints each address as the u32 of its bytes in network order.
            let prefix = u8::try_from(mask.count_ones()).ok()?;
            (gateway == 0 && flags & RTF_UP != 0 && prefix > 0)
                .then(|| Cidr::new(std::net::Ipv4Addr::from(dest.to_ne_bytes()).into(), prefix))
        })
        .collect()
}

/// The IPv6 networks of `/proc/net/if_inet6` (each address with its prefix length).
fn ipv6_addresses(text: &str) -> Vec<Cidr> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let addr = u128::from_str_radix(f.first()?, 16).ok()?;
            let prefix = u8::from_str_radix(f.get(2)?, 16).ok()?;
            (prefix > 0 && prefix <= 128)
                .then(|| Cidr::new(std::net::Ipv6Addr::from(addr).into(), prefix))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attached_ipv4_networks_are_taken_gateways_and_default_routes_are_not() {
        let route = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
            eth0\t00000000\t0100000A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
            eth0\t0000000A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
            eth1\t0012A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
            eth2\t0000A8C0\t0100000A\t0003\t0\t0\t0\t0000FFFF\t0\t0\t0\n\
            down\t00001FAC\t00000000\t0000\t0\t0\t0\t0000FFFF\t0\t0\t0\n";
        let nets: Vec<String> = ipv4_routes(route).iter().map(ToString::to_string).collect();
        assert_eq!(nets, ["10.0.0.0/24", "192.168.18.0/24"]);
    }

    #[test]
    fn ipv6_addresses_come_with_their_prefix() {
        let t = "00000000000000000000000000000001 01 80 10 80       lo\n\
                 fd000000000000000000000000000012 02 40 00 80     eth0\n";
        let nets: Vec<String> = ipv6_addresses(t).iter().map(ToString::to_string).collect();
        assert_eq!(nets, ["::1/128", "fd00::12/64"]);
        let fd: std::net::IpAddr = "fd00::99".parse().expect("literal");
        assert!(ipv6_addresses(t)[1].contains(fd));
    }

    #[test]
    fn the_default_always_holds_loopback() {
        let nets = local_networks();
        assert!(nets.iter().any(|n| n.contains([127, 0, 0, 2].into())));
        assert!(!nets.iter().any(|n| n.contains([198, 51, 100, 7].into())));
    }
}
