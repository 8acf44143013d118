//! Erasing a range of an NVMe namespace for a volume (a new window, a deleted one, a resize's
//! growth, an erase a crash left pending): in chunks, off the dataplane's control thread, with
//! the progress in the volume's message.

use super::plane::Plane;
use super::pool::blocking;
use super::table::Table;
use crate::error::VolumeError;
use crate::hooks::Point;
use crate::volume_id::VolumeId;

/// Erases `range` of NVMe namespace `device` for volume `id`, `ERASE_CHUNK` bytes at a
/// time on the blocking pool (never on the dataplane's control thread), saying how far it
/// got in the volume's message; `what` names the range in the log.
pub(super) async fn erase_range(
    table: &Table,
    plane: &Plane,
    id: &VolumeId,
    device: &std::path::Path,
    range: crate::record::EraseRange,
    what: &'static str,
) -> Result<(), VolumeError> {
    let identity = within_own_claim(table, id, device, range).await?;
    // The path names the record's namespace right now: after a boot that renamed the
    // namespaces, it may name another drive, whose blocks are not the volume's to erase.
    super::namespace::verify(plane, device, identity.as_ref()).await?;
    let handle = plane.handle()?;
    let total = range.to.saturating_sub(range.from);
    let started = std::time::Instant::now();
    let mut at = range.from;
    let mut how = None;
    while at < range.to {
        let len = (range.to - at).min(erase_chunk());
        let (h, d) = (handle.clone(), device.to_owned());
        how = Some(
            blocking(move || {
                crate::hooks::delay_point_blocking(Point::EraseChunk);
                h.erase_window(&d, at, len)
            })
            .await?,
        );
        at += len;
        if at < range.to {
            let done = at - range.from;
            table
                .set_message(
                    id,
                    &format!(
                        "erasing the {what}'s earlier content: {} of {} MiB",
                        done >> 20,
                        total >> 20
                    ),
                )
                .await;
        }
    }
    // The progress goes; a message that says something else stays.
    if let Some(v) = table.lock().await.get_mut(id) {
        if v.message.starts_with("erasing the ") {
            v.message.clear();
        }
    }
    if let Some(how) = how {
        tracing::info!(volume = %id, from = range.from, to = range.to, erase = how.name(),
            took_ms = started.elapsed().as_millis() as u64, "{what}: earlier content erased");
    }
    Ok(())
}

/// Refuses an erase of `range` unless volume `id`'s record, in the map, claims all of it on
/// `device` and no other record claims any of it: checked under the map lock, so that no
/// arithmetic slip upstream (a wrapped length, a stale record) can erase a neighbour. The
/// record's claim stays in the map while the erase runs, so no create places over it meanwhile.
/// Returns the namespace identity the record keeps.
async fn within_own_claim(
    table: &Table,
    id: &VolumeId,
    device: &std::path::Path,
    range: crate::record::EraseRange,
) -> Result<Option<ublkd_dataplane::NamespaceIdentity>, VolumeError> {
    let map = table.lock().await;
    let refuse = |why: &'static str| VolumeError::EraseOutsideClaim {
        id: id.clone(),
        device: device.to_owned(),
        from: range.from,
        to: range.to,
        why,
    };
    let identity = map.get(id).and_then(|v| match &v.record.backend {
        crate::backend::BackendRecord::Nvme { identity, .. } => identity.clone(),
        _ => None,
    });
    let own = map
        .get(id)
        .map(|v| crate::windows::claims(device, None, std::iter::once(&v.record), None))
        .unwrap_or_default();
    let Some(own) = own.first() else {
        return Err(refuse(
            "the volume's record claims no window of this namespace",
        ));
    };
    if range.from > range.to || range.from < own.start || own.end.is_some_and(|e| range.to > e) {
        return Err(refuse("the range leaves the volume's window"));
    }
    let records = map.values().map(|v| &v.record);
    let others = crate::windows::claims(device, identity.as_ref(), records, Some(id));
    if crate::windows::overlap(&others, range.from, range.to - range.from).is_some() {
        return Err(refuse("another volume's record claims part of the range"));
    }
    Ok(identity)
}

/// `ERASE_CHUNK`; in the simulator (whose namespaces are 48 MiB) 2 MiB, so that its erases
/// take several calls and a crash can fall between two.
fn erase_chunk() -> u64 {
    crate::seam::erase_chunk(ERASE_CHUNK)
}

/// How much of a window one erase call covers: small enough that a volume's progress shows and
/// a stop waits little, large enough that the calls cost nothing next to the erase.
const ERASE_CHUNK: u64 = 256 << 20;
