//! Work the manager does off the async runtime (on tokio's blocking pool) and the clock it
//! records times by: both through the simulator's seam (`crate::seam`).

use crate::error::VolumeError;

/// Now, in milliseconds since the epoch (the simulator's clock in its runs).
pub(super) fn now_ms() -> i64 {
    crate::seam::now_ms()
}

/// Runs blocking work (dataplane calls, file system calls) on tokio's blocking pool.
pub(super) async fn blocking<T: Send + 'static, E: Send + 'static>(
    f: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, VolumeError>
where
    VolumeError: From<E>,
{
    crate::seam::blocking(f)
        .await
        .map_err(|e| VolumeError::JoinDataplaneTask(e.to_string()))?
        .map_err(VolumeError::from)
}

/// Removes file `path` on the blocking pool (an unlink frees the file's extents: seconds for a
/// large one).
pub(super) async fn unlink(path: std::path::PathBuf) -> Result<(), VolumeError> {
    blocking(move || {
        std::fs::remove_file(&path)
            .map_err(|source| VolumeError::RemoveBackingFile { path, source })
    })
    .await
}
