//! Sizes: what a CreateVolume's capacity range, the file system's smallest device and the
//! content source make of a volume's size, and the same rounding for NodeExpandVolume.

use crate::error::CsiError;
use crate::spec;

/// Size of a volume whose request names none.
pub const DEFAULT_SIZE: u64 = 1 << 30;

/// The size to give a volume: the request's minimum (or the default) rounded up to the block
/// size, within its limit.
pub fn size_for(range: Option<&spec::CapacityRange>, block: u64) -> Result<u64, CsiError> {
    let (required, limit) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
    if required < 0 || limit < 0 {
        return Err(CsiError::OutOfRange("capacity range is negative".into()));
    }
    let (required, limit) = (required as u64, limit as u64);
    let want = if required == 0 {
        if limit > 0 {
            DEFAULT_SIZE.min(limit)
        } else {
            DEFAULT_SIZE
        }
    } else {
        required
    };
    let size = want
        .checked_next_multiple_of(block)
        .ok_or_else(|| CsiError::OutOfRange(format!("{want} bytes")))?;
    if limit > 0 && size > limit {
        return Err(CsiError::OutOfRange(format!(
            "{required} bytes rounded up to the block size ({size}) exceed the limit of {limit}"
        )));
    }
    Ok(size)
}

/// The floors a volume's size is raised to, each saying why in a refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Floor {
    /// The smallest device its file system is made on: a claim of 64 MiB in an xfs class gets
    /// 300 MiB, as cloud drivers round up to their smallest disk.
    FileSystem,
    /// The size of its source (the spec: a volume is never smaller than its source).
    Source,
}

/// `size`, raised to `floor` bytes rounded up to the block, within the limit.
pub fn at_least(
    size: u64,
    floor: u64,
    why: Floor,
    block: u64,
    limit: Option<&spec::CapacityRange>,
) -> Result<u64, CsiError> {
    if size >= floor {
        return Ok(size);
    }
    let raised = floor
        .checked_next_multiple_of(block)
        .ok_or_else(|| CsiError::OutOfRange(format!("{floor} bytes")))?;
    let limit = limit.map_or(0, |r| r.limit_bytes.max(0) as u64);
    if limit > 0 && raised > limit {
        let needs = match why {
            Floor::FileSystem => format!("its file system needs at least {raised} bytes"),
            Floor::Source => format!("the source holds {floor} bytes"),
        };
        return Err(CsiError::OutOfRange(format!(
            "{needs}, more than the limit of {limit}"
        )));
    }
    Ok(raised)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_up_to_the_block_and_respect_the_limit() {
        let r = |required, limit| spec::CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        };
        assert_eq!(size_for(None, 4096).unwrap(), DEFAULT_SIZE);
        assert_eq!(size_for(Some(&r(1, 0)), 4096).unwrap(), 4096);
        assert_eq!(size_for(Some(&r(4097, 8192)), 4096).unwrap(), 8192);
        assert_eq!(size_for(Some(&r(0, 8192)), 512).unwrap(), 8192);
        assert_eq!(
            size_for(Some(&r(4097, 5000)), 4096).unwrap_err().code(),
            tonic::Code::OutOfRange
        );
        assert!(size_for(Some(&r(-1, 0)), 4096).is_err());
        let xfs = 300 << 20;
        assert_eq!(
            at_least(
                64 << 20,
                xfs,
                Floor::FileSystem,
                4096,
                Some(&r(64 << 20, 0))
            )
            .unwrap(),
            xfs
        );
        assert_eq!(
            at_least(1 << 30, xfs, Floor::FileSystem, 4096, None).unwrap(),
            1 << 30
        );
        assert_eq!(
            at_least(4096, 0, Floor::FileSystem, 4096, None).unwrap(),
            4096
        );
        let e = at_least(
            64 << 20,
            xfs,
            Floor::FileSystem,
            4096,
            Some(&r(0, 128 << 20)),
        )
        .unwrap_err();
        assert_eq!(e.code(), tonic::Code::OutOfRange, "{e}");
    }

    #[test]
    fn a_volume_from_a_source_is_never_smaller_than_it() {
        let r = |limit| spec::CapacityRange {
            required_bytes: 4096,
            limit_bytes: limit,
        };
        assert_eq!(
            at_least(8192, 4096, Floor::Source, 4096, None).unwrap(),
            8192
        );
        assert_eq!(
            at_least(4096, 6000, Floor::Source, 4096, None).unwrap(),
            8192
        );
        assert_eq!(
            at_least(4096, 8192, Floor::Source, 4096, Some(&r(8192))).unwrap(),
            8192
        );
        assert_eq!(
            at_least(4096, 8193, Floor::Source, 4096, Some(&r(8192)))
                .unwrap_err()
                .code(),
            tonic::Code::OutOfRange
        );
    }
}
