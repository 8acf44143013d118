//! Where the volume simulator (`volumes::sim`, `simctx`) plugs into the manager: each effect on
//! the world that the simulator must see or shape — a registry write, a blocking call, the
//! clock, a lock's scheduling point, an erase's chunk, a reflink, a RAM file's removal — passes
//! through one function here. A shipped build gets `world`, what the world does, and no shipped
//! function holds a branch of the simulator's; a test build gets `simulated`, which asks
//! `simctx` first (a pass-through to `world` unless a simulation runs on the thread).

#[cfg(not(test))]
pub use world::*;

#[cfg(test)]
pub use simulated::*;

/// What the world does.
mod world {
    use std::fs::File;
    use std::io;
    use std::path::Path;

    /// Before a registry file is written (`tmp`, then renamed): whether the process lives to
    /// write it (in the world, always).
    #[cfg_attr(test, allow(dead_code))]
    pub fn registry_put(
        _what: impl FnOnce() -> String,
        _tmp: &Path,
        _body: &[u8],
    ) -> io::Result<()> {
        Ok(())
    }

    /// Before a registry file is removed: whether the process lives to remove it.
    #[cfg_attr(test, allow(dead_code))]
    pub fn registry_remove(_what: impl FnOnce() -> String) -> io::Result<()> {
        Ok(())
    }

    /// Before an effect outside the registry (a RAM volume's file removed): whether it happens.
    #[cfg_attr(test, allow(dead_code))]
    pub fn lives() -> bool {
        true
    }

    /// Milliseconds since the epoch, as records are stamped.
    pub fn now_ms() -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64)
    }

    /// Runs `f` on tokio's blocking pool.
    pub async fn blocking<T: Send + 'static>(
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, tokio::task::JoinError> {
        tokio::task::spawn_blocking(f).await
    }

    /// Where another task may run first (a lock about to be taken): nothing to do.
    #[cfg_attr(test, allow(dead_code))]
    pub async fn schedule_point() {}

    /// An erase call's length.
    pub fn erase_chunk(real: u64) -> u64 {
        real
    }

    /// `dst` made to share `src`'s blocks (FICLONE).
    pub fn share_blocks(dst: &File, src: &File) -> io::Result<()> {
        crate::sys::reflink(dst, src)
    }
}

/// The simulator's: each function asks `simctx`, and is the world's outside a simulation.
#[cfg(test)]
mod simulated {
    use crate::simctx::{self, Fate};
    use std::fs::File;
    use std::io;
    use std::path::Path;

    fn died() -> io::Error {
        io::Error::other("the simulated process died")
    }

    /// A crash here tears the write: half of `body` is what `tmp` is left with.
    pub fn registry_put(what: impl FnOnce() -> String, tmp: &Path, body: &[u8]) -> io::Result<()> {
        simctx::registry_write(&what());
        match simctx::effect() {
            Fate::Go => Ok(()),
            Fate::DiesNow => {
                std::fs::write(tmp, &body[..body.len() / 2])?;
                Err(died())
            }
            Fate::Dead => Err(died()),
        }
    }

    pub fn registry_remove(what: impl FnOnce() -> String) -> io::Result<()> {
        simctx::registry_write(&what());
        match simctx::effect() {
            Fate::Go => Ok(()),
            Fate::DiesNow | Fate::Dead => Err(died()),
        }
    }

    pub fn lives() -> bool {
        simctx::effect() == Fate::Go
    }

    /// The simulator's counter: one millisecond further at each reading.
    pub fn now_ms() -> i64 {
        simctx::now_ms().unwrap_or_else(super::world::now_ms)
    }

    /// Inline, taking the virtual time the simulated kernel says.
    pub async fn blocking<T: Send + 'static>(
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, tokio::task::JoinError> {
        if !simctx::on() {
            return super::world::blocking(f).await;
        }
        simctx::checkpoint().await;
        let r = simctx::in_blocking(f);
        simctx::after_call().await;
        Ok(r)
    }

    /// The simulator's seeded yields.
    pub async fn schedule_point() {
        simctx::schedule_point().await;
    }

    /// 2 MiB: the simulated namespaces are small, so an erase takes several calls and a crash
    /// can fall between two.
    pub fn erase_chunk(real: u64) -> u64 {
        if simctx::on() {
            2 << 20
        } else {
            super::world::erase_chunk(real)
        }
    }

    /// A copy: the simulation's temporary directory may not reflink.
    pub fn share_blocks(dst: &File, src: &File) -> io::Result<()> {
        if !simctx::on() {
            return super::world::share_blocks(dst, src);
        }
        let (mut dst, mut src) = (dst, src);
        io::copy(&mut src, &mut dst).map(drop)
    }
}
