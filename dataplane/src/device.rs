//! What a device (volume) is: its spec, the checks on it, and the kernel structures built from it.

use crate::backend::{BackendSpec, Limits};
use crate::features::Features;
use crate::ids::DevId;
use crate::qos::QosLimits;
use crate::sys;

/// Largest single request, and so each tag's buffer size.
pub const DEFAULT_MAX_IO_BYTES: u32 = 512 * 1024;

/// Which ublk I/O protocol serves the device's queues. Stored (serde feature) by its `name`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum IoPath {
    /// BATCH_IO when the kernel offers it, else per-IO.
    #[default]
    Auto,
    /// PREP / multishot FETCH / COMMIT of many tags per command (UBLK_F_BATCH_IO).
    Batch,
    /// FETCH_REQ / COMMIT_AND_FETCH_REQ per tag (every ublk kernel).
    /// Named `per-io` (logs, metric labels, `ublkd run`). The registry keeps storing
    /// `per_io`, which every release reads (older ones would refuse `per-io`), and reads both.
    #[cfg_attr(feature = "serde", serde(alias = "per-io"))]
    PerIo,
}

impl IoPath {
    pub fn name(self) -> &'static str {
        match self {
            IoPath::Auto => "auto",
            IoPath::Batch => "batch",
            IoPath::PerIo => "per-io",
        }
    }

    /// The path actually used on a kernel offering `features`, for queues of `depth` tags
    /// (the kernel refuses BATCH_IO below [`MIN_BATCH_DEPTH`]; `Auto` then takes per-IO).
    pub fn resolve(self, features: Features, depth: u16) -> Result<IoPath, SpecError> {
        let batch = features.contains(Features::BATCH_IO);
        match self {
            IoPath::Auto if batch && depth >= MIN_BATCH_DEPTH => Ok(IoPath::Batch),
            IoPath::Auto => Ok(IoPath::PerIo),
            IoPath::Batch if !batch => Err(SpecError::Unsupported("BATCH_IO")),
            IoPath::Batch if depth < MIN_BATCH_DEPTH => Err(SpecError::BatchDepth(depth)),
            p => Ok(p),
        }
    }
}

/// The smallest queue depth the kernel accepts for a BATCH_IO device.
pub const MIN_BATCH_DEPTH: u16 = 2;

/// A per-device choice the kernel or backend may not offer: `Auto` takes it when offered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum Toggle {
    #[default]
    Auto,
    On,
    Off,
}

impl Toggle {
    pub fn name(self) -> &'static str {
        match self {
            Toggle::Auto => "auto",
            Toggle::On => "on",
            Toggle::Off => "off",
        }
    }

    /// Resolves against whether the choice is `offered`; `what` names it in the error.
    pub fn resolve(self, offered: Result<(), &'static str>) -> Result<bool, SpecError> {
        match (self, offered) {
            (Toggle::Off, _) => Ok(false),
            (Toggle::Auto, r) => Ok(r.is_ok()),
            (Toggle::On, Ok(())) => Ok(true),
            (Toggle::On, Err(why)) => Err(SpecError::Unsupported(why)),
        }
    }
}

/// A device to create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    pub size_bytes: u64,
    pub block_size: u32,
    pub queues: u16,
    pub queue_depth: u16,
    pub io_path: IoPath,
    pub backend: BackendSpec,
    pub max_io_bytes: u32,
    /// Kernel device id to ask for (`/dev/ublkbN`); None lets the kernel choose.
    pub dev_id: Option<DevId>,
    /// Zero copy (UBLK_F_AUTO_BUF_REG): backends read and write the request's own pages.
    pub zero_copy: Toggle,
    /// Poll for NVMe completions (IORING_SETUP_IOPOLL on the controller's poll queues).
    pub poll: Toggle,
    /// I/O limits (all zero: unlimited), enforced by the workers; changed live by
    /// `Handle::set_qos`.
    pub qos: QosLimits,
    /// A new volume: what an earlier user left in the backend's range (an NVMe window) is made
    /// unreadable before the device appears (`Backend::erase`). Never for a volume that already
    /// holds its tenant's data (a restore after a restart).
    pub erase: bool,
}

impl Default for DeviceSpec {
    fn default() -> Self {
        Self {
            size_bytes: 0,
            block_size: 4096,
            queues: 1,
            queue_depth: 128,
            io_path: IoPath::Auto,
            backend: BackendSpec::Null,
            max_io_bytes: DEFAULT_MAX_IO_BYTES,
            dev_id: None,
            zero_copy: Toggle::Auto,
            poll: Toggle::Auto,
            qos: QosLimits::default(),
            erase: false,
        }
    }
}

/// What a kernel device fixed at its creation, as a takeover reads it back (GET_DEV_INFO and
/// GET_PARAMS): the parameters a spec must agree with to serve it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelShape {
    pub queues: u16,
    pub queue_depth: u16,
    pub flags: u64,
    pub logical_bs_shift: u8,
    pub dev_sectors: u64,
}

impl KernelShape {
    /// The shape of a device made from `info` and `params` (what ADD_DEV and SET_PARAMS gave).
    pub(crate) fn of(info: &sys::ublksrv_ctrl_dev_info, params: &sys::ublk_params) -> Self {
        Self {
            queues: info.nr_hw_queues,
            queue_depth: info.queue_depth,
            flags: info.flags,
            logical_bs_shift: params.basic.logical_bs_shift,
            dev_sectors: params.basic.dev_sectors,
        }
    }
}

/// A spec the dataplane refuses, named for the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("size must be greater than 0")]
    SizeZero,
    #[error("size {size} is not a multiple of the block size {block_size}")]
    SizeUnaligned { size: u64, block_size: u32 },
    #[error("block size {0} must be a power of two from 512 to 4096")]
    BlockSize(u32),
    #[error("queue depth {0} must be from 1 to 4096")]
    QueueDepth(u16),
    #[error("queue count {requested} must be from 1 to {max}")]
    Queues { requested: u16, max: u16 },
    #[error("max I/O size {0} must be a multiple of 4096 from 4096 to 32 MiB")]
    MaxIo(u32),
    #[error("the kernel does not offer {0}")]
    Unsupported(&'static str),
    #[error("queue depth {0} is below 2, the least the batch I/O path accepts")]
    BatchDepth(u16),
}

impl DeviceSpec {
    /// Checks the spec; `max_queues` is the kernel's limit (one per possible CPU).
    pub fn validate(&self, max_queues: u16) -> Result<(), SpecError> {
        if !self.block_size.is_power_of_two() || !(512..=4096).contains(&self.block_size) {
            return Err(SpecError::BlockSize(self.block_size));
        }
        if self.size_bytes == 0 {
            return Err(SpecError::SizeZero);
        }
        if self.size_bytes % u64::from(self.block_size) != 0 {
            return Err(SpecError::SizeUnaligned {
                size: self.size_bytes,
                block_size: self.block_size,
            });
        }
        if self.queue_depth == 0 || self.queue_depth > sys::UBLK_MAX_QUEUE_DEPTH {
            return Err(SpecError::QueueDepth(self.queue_depth));
        }
        let max = max_queues.min(sys::UBLK_MAX_NR_QUEUES);
        if self.queues == 0 || self.queues > max {
            return Err(SpecError::Queues {
                requested: self.queues,
                max,
            });
        }
        if self.max_io_bytes < 4096 || self.max_io_bytes % 4096 != 0 || self.max_io_bytes > 1 << 25
        {
            return Err(SpecError::MaxIo(self.max_io_bytes));
        }
        Ok(())
    }

    /// The shape of the device this spec makes on a kernel that offers every feature, with
    /// `path` and `zero_copy` as resolved (for the tests of what reaches the kernel).
    pub fn made_shape(&self, path: IoPath, zero_copy: bool) -> KernelShape {
        let info = self.dev_info(self.wanted_flags(Features(u64::MAX), path, zero_copy));
        KernelShape::of(&info, &self.params(None))
    }

    /// Why a kernel device of `shape` cannot serve this spec when taken over (None: it can):
    /// each parameter the spec holds that the kernel fixed at the device's creation — queues,
    /// depth, block size, an I/O path asked by name, zero copy asked on. The size is not one:
    /// a takeover never shrinks a device and grows one the record says is larger.
    pub fn takeover_mismatch(&self, shape: &KernelShape) -> Option<String> {
        let mut why = Vec::new();
        if (shape.queues, shape.queue_depth) != (self.queues, self.queue_depth) {
            why.push(format!(
                "the kernel device has {} queue(s) of depth {}, the volume {} of depth {}",
                shape.queues, shape.queue_depth, self.queues, self.queue_depth
            ));
        }
        let shift = self.block_size.trailing_zeros();
        if u32::from(shape.logical_bs_shift) != shift {
            why.push(format!(
                "the kernel device's blocks are {} bytes, the volume's {}",
                1u64 << shape.logical_bs_shift.min(63),
                self.block_size
            ));
        }
        let batch = shape.flags & sys::UBLK_F_BATCH_IO != 0;
        match (self.io_path, batch) {
            (IoPath::Batch, false) => {
                why.push("the kernel device is per-I/O, the volume batch".into())
            }
            (IoPath::PerIo, true) => {
                why.push("the kernel device is batch, the volume per-I/O".into())
            }
            (IoPath::Auto | IoPath::Batch | IoPath::PerIo, _) => {}
        }
        let zero_copy = shape.flags & sys::UBLK_F_AUTO_BUF_REG != 0;
        if self.zero_copy == Toggle::On && !zero_copy {
            why.push("the kernel device has no zero copy, the volume asks it on".into());
        }
        (!why.is_empty()).then(|| why.join("; "))
    }

    /// Flags to ask ADD_DEV for, given the kernel's features, the resolved path and whether
    /// zero copy is on. Zero copy adds USER_COPY where offered: it is how a request whose
    /// buffer the kernel could not register is still served (by copy).
    pub fn wanted_flags(&self, features: Features, path: IoPath, zero_copy: bool) -> u64 {
        let mut flags = sys::UBLK_F_CMD_IOCTL_ENCODE;
        for optional in [
            sys::UBLK_F_USER_RECOVERY,
            sys::UBLK_F_USER_RECOVERY_REISSUE,
            sys::UBLK_F_UPDATE_SIZE,
            sys::UBLK_F_QUIESCE,
        ] {
            if features.0 & optional != 0 {
                flags |= optional;
            }
        }
        if path == IoPath::Batch {
            flags |= sys::UBLK_F_BATCH_IO;
        }
        if zero_copy {
            flags |= sys::UBLK_F_AUTO_BUF_REG | (features.0 & sys::UBLK_F_USER_COPY);
        }
        flags
    }

    pub fn dev_info(&self, flags: u64) -> sys::ublksrv_ctrl_dev_info {
        sys::ublksrv_ctrl_dev_info {
            nr_hw_queues: self.queues,
            queue_depth: self.queue_depth,
            max_io_buf_bytes: self.max_io_bytes,
            dev_id: self.dev_id.map_or(u32::MAX, |d| d.0),
            ublksrv_pid: i32::try_from(std::process::id()).unwrap_or(0),
            flags,
            ..Default::default()
        }
    }

    /// SET_PARAMS for this device: capacity, block sizes, limits, cache and FUA, discard,
    /// narrowed by the backend's own `limits` when it has them.
    pub fn params(&self, limits: Option<&Limits>) -> sys::ublk_params {
        let shift = self.block_size.trailing_zeros() as u8;
        let max_io = limits.map_or(self.max_io_bytes, |l| l.max_io_bytes.min(self.max_io_bytes));
        let cache = limits.is_none_or(|l| l.volatile_cache);
        let sectors = |bytes: u64| u32::try_from(bytes / 512).unwrap_or(u32::MAX >> 9);
        let mut p = sys::ublk_params {
            len: size_of::<sys::ublk_params>() as u32,
            types: sys::UBLK_PARAM_TYPE_BASIC,
            basic: sys::ublk_param_basic {
                attrs: if cache {
                    sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA
                } else {
                    0
                },
                logical_bs_shift: shift,
                physical_bs_shift: shift.max(12),
                io_opt_shift: 12u8.max(shift),
                io_min_shift: shift,
                max_sectors: max_io / 512,
                dev_sectors: self.size_bytes / 512,
                virt_boundary_mask: limits.map_or(0, |l| l.virt_boundary_mask),
                ..Default::default()
            },
            ..Default::default()
        };
        let (discard, zeroes) = limits.map_or((u32::MAX >> 9, u32::MAX >> 9), |l| {
            (
                sectors(l.max_discard_bytes).min(u32::MAX >> 9),
                sectors(l.max_write_zeroes_bytes).min(u32::MAX >> 9),
            )
        });
        if discard > 0 || zeroes > 0 {
            p.types |= sys::UBLK_PARAM_TYPE_DISCARD;
            p.discard = sys::ublk_param_discard {
                discard_alignment: 0,
                discard_granularity: 4096.max(self.block_size),
                max_discard_sectors: discard,
                max_write_zeroes_sectors: zeroes,
                max_discard_segments: 1,
                reserved0: 0,
            };
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> DeviceSpec {
        DeviceSpec {
            size_bytes: 1 << 30,
            ..Default::default()
        }
    }

    /// A device made from a spec is taken over by that spec; each parameter the kernel fixed,
    /// changed in the spec, is named as the reason it cannot.
    #[test]
    fn a_spec_takes_over_the_device_it_made_and_no_other() {
        let spec = DeviceSpec {
            size_bytes: 1 << 30,
            block_size: 512,
            queues: 2,
            queue_depth: 64,
            io_path: IoPath::Batch,
            zero_copy: Toggle::On,
            ..Default::default()
        };
        let features = Features(u64::MAX);
        let info = spec.dev_info(spec.wanted_flags(features, IoPath::Batch, true));
        let shape = KernelShape::of(&info, &spec.params(None));
        assert_eq!(shape.dev_sectors, (1 << 30) / 512);
        assert_eq!(spec.takeover_mismatch(&shape), None);
        type Change = (&'static str, fn(&mut DeviceSpec));
        let changed: [Change; 5] = [
            ("queue", |s| s.queues = 3),
            ("depth", |s| s.queue_depth = 128),
            ("blocks", |s| s.block_size = 4096),
            ("per-I/O", |s| s.io_path = IoPath::PerIo),
            ("bigger", |s| s.size_bytes = 2 << 30),
        ];
        for (word, change) in changed {
            let mut other = spec.clone();
            change(&mut other);
            let why = other.takeover_mismatch(&shape);
            match word {
                "bigger" => assert_eq!(why, None, "a larger size is applied, not refused"),
                _ => assert!(
                    why.as_deref().is_some_and(|w| w.contains(word)),
                    "{word}: {why:?}"
                ),
            }
        }
        let copy = spec.dev_info(spec.wanted_flags(features, IoPath::PerIo, false));
        let copy = KernelShape::of(&copy, &spec.params(None));
        let why = spec.takeover_mismatch(&copy).unwrap_or_default();
        assert!(
            why.contains("zero copy") && why.contains("per-I/O"),
            "{why}"
        );
        let auto = DeviceSpec {
            io_path: IoPath::Auto,
            zero_copy: Toggle::Auto,
            ..spec.clone()
        };
        assert_eq!(auto.takeover_mismatch(&copy), None, "auto takes either");
    }

    #[test]
    fn rejects_each_bad_field_with_its_own_error() {
        assert_eq!(spec().validate(4), Ok(()));
        let bad = |f: fn(&mut DeviceSpec)| {
            let mut s = spec();
            f(&mut s);
            s.validate(4).unwrap_err()
        };
        assert_eq!(bad(|s| s.size_bytes = 0), SpecError::SizeZero);
        assert!(matches!(
            bad(|s| s.size_bytes = 4097),
            SpecError::SizeUnaligned { .. }
        ));
        assert_eq!(bad(|s| s.block_size = 1000), SpecError::BlockSize(1000));
        assert_eq!(bad(|s| s.block_size = 8192), SpecError::BlockSize(8192));
        assert_eq!(bad(|s| s.queue_depth = 0), SpecError::QueueDepth(0));
        assert_eq!(bad(|s| s.queue_depth = 4097), SpecError::QueueDepth(4097));
        assert!(matches!(bad(|s| s.queues = 0), SpecError::Queues { .. }));
        assert_eq!(
            bad(|s| s.queues = 5),
            SpecError::Queues {
                requested: 5,
                max: 4
            }
        );
        assert_eq!(bad(|s| s.max_io_bytes = 1000), SpecError::MaxIo(1000));
    }

    #[test]
    fn auto_path_follows_the_kernel() {
        let batch = Features(sys::UBLK_F_BATCH_IO);
        assert_eq!(IoPath::Auto.resolve(batch, 32), Ok(IoPath::Batch));
        assert_eq!(IoPath::Auto.resolve(Features(0), 32), Ok(IoPath::PerIo));
        assert_eq!(
            IoPath::Batch.resolve(Features(0), 32),
            Err(SpecError::Unsupported("BATCH_IO"))
        );
        assert_eq!(IoPath::PerIo.resolve(batch, 32), Ok(IoPath::PerIo));
        // Depth 1: the kernel refuses BATCH_IO; auto takes per-IO, an explicit batch is refused.
        assert_eq!(IoPath::Auto.resolve(batch, 1), Ok(IoPath::PerIo));
        assert_eq!(
            IoPath::Batch.resolve(batch, 1),
            Err(SpecError::BatchDepth(1))
        );
    }

    #[test]
    fn params_carry_capacity_and_limits() {
        let p = spec().params(None);
        assert_eq!(p.basic.dev_sectors, (1 << 30) / 512);
        assert_eq!(p.basic.logical_bs_shift, 12);
        assert_eq!(p.basic.max_sectors, DEFAULT_MAX_IO_BYTES / 512);
        assert_ne!(p.basic.attrs & sys::UBLK_ATTR_FUA, 0);
        assert_ne!(p.types & sys::UBLK_PARAM_TYPE_DISCARD, 0);
        let f = spec().wanted_flags(Features(u64::MAX), IoPath::Batch, false);
        assert_ne!(f & sys::UBLK_F_BATCH_IO, 0);
        assert_ne!(f & sys::UBLK_F_USER_RECOVERY_REISSUE, 0);
        assert_eq!(f & sys::UBLK_F_AUTO_BUF_REG, 0);
        assert_eq!(
            spec().wanted_flags(Features(0), IoPath::PerIo, false) & sys::UBLK_F_BATCH_IO,
            0
        );
        let zc = spec().wanted_flags(Features(u64::MAX), IoPath::Batch, true);
        assert_ne!(zc & sys::UBLK_F_AUTO_BUF_REG, 0);
        assert_ne!(
            zc & sys::UBLK_F_USER_COPY,
            0,
            "fallback served by user copy"
        );
    }

    #[test]
    fn backend_limits_narrow_the_params() {
        let l = Limits {
            block_size: 512,
            max_io_bytes: 128 * 1024,
            max_discard_bytes: 0,
            max_write_zeroes_bytes: 0,
            volatile_cache: false,
            virt_boundary_mask: 4095,
        };
        let p = spec().params(Some(&l));
        assert_eq!(p.basic.max_sectors, 256);
        assert_eq!(p.basic.attrs & sys::UBLK_ATTR_VOLATILE_CACHE, 0);
        assert_eq!(p.types & sys::UBLK_PARAM_TYPE_DISCARD, 0);
        assert_eq!(p.basic.virt_boundary_mask, 4095);
        assert_eq!(Toggle::Auto.resolve(Err("x")), Ok(false));
        assert_eq!(
            Toggle::On.resolve(Err("x")),
            Err(SpecError::Unsupported("x"))
        );
        assert_eq!(Toggle::Off.resolve(Ok(())), Ok(false));
    }
}
