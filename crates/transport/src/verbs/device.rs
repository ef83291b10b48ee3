//! Device discovery: open a device, pick its RoCE v2 IPv4-mapped GID, read the port's MTU.

use std::{fmt, net::Ipv4Addr, sync::Arc};

use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::DeviceContext;

use super::{ProtectionDomain, VerbsError};

/// `IBV_PORT_ACTIVE`.
const PORT_ACTIVE: u32 = 4;
/// `IBV_GID_TYPE_SYSFS_ROCE_V2`: what `ibv_query_gid_type` reports for a RoCE v2 GID.
const GID_TYPE_ROCE_V2: u32 = 1;

/// Which device to open.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Device name (`mlx5_0`, `rxeP`); `None` takes the first usable one.
    pub name: Option<String>,
    /// The IPv4 address whose RoCE v2 GID to use; `None` takes the first IPv4-mapped one.
    pub ipv4: Option<Ipv4Addr>,
    /// The physical port (1-based).
    pub port: u8,
}

impl DeviceConfig {
    /// The first usable device, port 1.
    pub fn any() -> Self {
        Self {
            name: None,
            ipv4: None,
            port: 1,
        }
    }

    /// The named device, port 1.
    pub fn named(name: impl Into<String>) -> Self {
        Self {
            name: Some(name.into()),
            ..Self::any()
        }
    }

    /// Use the RoCE v2 GID of this IPv4 address.
    #[must_use]
    pub fn with_ipv4(mut self, addr: Ipv4Addr) -> Self {
        self.ipv4 = Some(addr);
        self
    }
}

/// A 128-bit RoCE/InfiniBand global identifier.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        std::net::Ipv6Addr::from(self.0).to_ipv4_mapped()
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&std::net::Ipv6Addr::from(self.0), f)
    }
}

/// An opened RDMA device: context, port, GID and limits. Cheap to clone.
#[derive(Clone)]
pub struct Device {
    pub(crate) inner: Arc<DeviceInner>,
}

/// What every child object keeps alive (through an `Arc`): the device context.
pub(crate) struct DeviceInner {
    pub(crate) name: String,
    pub(crate) port: u8,
    pub(crate) gid_index: u8,
    pub(crate) gid: Gid,
    /// `ibv_mtu` value (1 = 256 … 5 = 4096) of the port's active MTU.
    pub(crate) active_mtu: u8,
    /// Outstanding RDMA READs this device serves as responder, per QP (`max_qp_rd_atom`).
    pub(crate) max_qp_rd_atom: u8,
    /// Outstanding RDMA READs this device may issue, per QP (`max_qp_init_rd_atom`).
    pub(crate) max_qp_init_rd_atom: u8,
    /// Largest work queue (`max_qp_wr`).
    pub(crate) max_qp_wr: u32,
    /// Closed last (`ibv_close_device`) when the final child drops.
    pub(crate) ctx: Arc<DeviceContext>,
}

impl Device {
    /// Opens a device as `config` says.
    ///
    /// A machine without libibverbs, without devices, or without an active port with a
    /// RoCE v2 IPv4-mapped GID gets [`VerbsError::NoDevice`] with the reason (never a panic:
    /// the device list comes back empty when the library cannot be loaded).
    ///
    /// # Errors
    /// [`VerbsError::NoDevice`] when nothing usable is found; [`VerbsError::Device`] when a
    /// query of the named device fails.
    pub fn open(config: &DeviceConfig) -> Result<Self, VerbsError> {
        let list = DeviceList::new().map_err(|e| VerbsError::NoDevice {
            reason: format!("libibverbs unavailable or no device list ({e})"),
        })?;
        if list.is_empty() {
            return Err(VerbsError::NoDevice {
                reason: "libibverbs found no RDMA devices".into(),
            });
        }
        let mut reasons = Vec::new();
        for dev in &list {
            let name = dev.name();
            if config.name.as_ref().is_some_and(|want| *want != name) {
                continue;
            }
            let ctx = match dev.open() {
                Ok(ctx) => ctx,
                Err(e) => {
                    reasons.push(format!("{name}: open failed ({e})"));
                    continue;
                }
            };
            match Self::probe(name.clone(), ctx, config) {
                Ok(inner) => {
                    tracing::debug!(
                        device = %inner.name, gid = %inner.gid, gid_index = inner.gid_index,
                        mtu = mtu_bytes(inner.active_mtu), "opened RDMA device"
                    );
                    return Ok(Self {
                        inner: Arc::new(inner),
                    });
                }
                Err(reason) => reasons.push(format!("{name}: {reason}")),
            }
        }
        let reason = match (&config.name, reasons.is_empty()) {
            (Some(want), true) => format!("no device named {want}"),
            _ => reasons.join("; "),
        };
        Err(VerbsError::NoDevice { reason })
    }

    /// Checks the port and finds the GID; the reason on failure.
    fn probe(
        name: String,
        ctx: Arc<DeviceContext>,
        config: &DeviceConfig,
    ) -> Result<DeviceInner, String> {
        let dev_attr = ctx
            .query_device()
            .map_err(|e| format!("query_device failed ({e})"))?;
        let port_attr = ctx
            .query_port(config.port)
            .map_err(|e| format!("query_port({}) failed ({e})", config.port))?;
        // Raw fields only: sideway's enum conversions panic on values they do not know.
        let raw = &port_attr.attr;
        if raw.state != PORT_ACTIVE {
            return Err(format!(
                "port {} is not active (state {})",
                config.port, raw.state
            ));
        }
        if !(1..=5).contains(&raw.active_mtu) {
            return Err(format!("unknown active_mtu value {}", raw.active_mtu));
        }
        let (gid_index, gid) = find_gid(&ctx, config.port, raw.gid_tbl_len, config.ipv4)?;
        let clamp = |v: i32| u8::try_from(v.clamp(0, 255)).unwrap_or(u8::MAX);
        Ok(DeviceInner {
            name,
            port: config.port,
            gid_index,
            gid,
            // In 1..=5, checked above.
            active_mtu: u8::try_from(raw.active_mtu).unwrap_or(3),
            max_qp_rd_atom: clamp(dev_attr.max_qp_rd_atom()),
            max_qp_init_rd_atom: clamp(dev_attr.max_qp_init_rd_atom()),
            max_qp_wr: u32::try_from(dev_attr.max_qp_wr()).unwrap_or(0),
            ctx,
        })
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The GID this device's queue pairs use as source.
    pub fn gid(&self) -> Gid {
        self.inner.gid
    }

    /// The port's active MTU in bytes (256 … 4096).
    pub fn active_mtu(&self) -> u32 {
        mtu_bytes(self.inner.active_mtu)
    }

    /// Outstanding RDMA READs per queue pair that this device serves (`max_qp_rd_atom`).
    pub fn max_qp_rd_atom(&self) -> u8 {
        self.inner.max_qp_rd_atom
    }

    /// Allocates a protection domain.
    ///
    /// # Errors
    /// [`VerbsError::Device`] when `ibv_alloc_pd` fails.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain, VerbsError> {
        ProtectionDomain::new(self.clone())
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.inner.name)
            .field("port", &self.inner.port)
            .field("gid", &self.inner.gid)
            .field("gid_index", &self.inner.gid_index)
            .field("active_mtu", &mtu_bytes(self.inner.active_mtu))
            .finish_non_exhaustive()
    }
}

/// Bytes of an `ibv_mtu` value.
pub(crate) fn mtu_bytes(mtu: u8) -> u32 {
    128u32 << mtu.clamp(1, 5)
}

/// Finds the RoCE v2 IPv4-mapped GID (of `want`, if given) by type and address.
fn find_gid(
    ctx: &DeviceContext,
    port: u8,
    table_len: i32,
    want: Option<Ipv4Addr>,
) -> Result<(u8, Gid), String> {
    let mut seen = Vec::new();
    for index in 0..u32::try_from(table_len.clamp(0, 256)).unwrap_or(0) {
        // Empty entries may fail to query: skip them.
        let Ok(gid) = ctx.query_gid(port, index) else {
            continue;
        };
        let gid = Gid(gid.raw);
        let Some(v4) = gid.ipv4() else { continue };
        if v4.is_unspecified() {
            continue;
        }
        let Ok(kind) = ctx.query_gid_type(port, index) else {
            continue;
        };
        if kind != GID_TYPE_ROCE_V2 {
            continue;
        }
        if want.is_none_or(|w| w == v4) {
            let index = u8::try_from(index).map_err(|_| "GID index above 255".to_owned())?;
            return Ok((index, gid));
        }
        seen.push(v4.to_string());
    }
    Err(match want {
        Some(w) => format!("no RoCE v2 GID for {w} (found: [{}])", seen.join(", ")),
        None => "no RoCE v2 IPv4-mapped GID (is an IPv4 address set on its netdev?)".into(),
    })
}
