//! Where the volume simulator (`volumes::sim`, test builds only) holds the manager's effects:
//! every registry write and device call is a step it may kill the process at, device calls run
//! inline and take the virtual time the simulated kernel says, and the clock is a counter.
//! Off (every function a pass-through) unless a simulation on this thread turned it on.

use std::cell::RefCell;
use std::time::Duration;

#[derive(Debug, Default)]
struct Ctx {
    on: bool,
    /// The simulated process died: nothing it does has an effect any more.
    dead: bool,
    /// Effects (registry writes, device calls) made since the start of the history.
    effects: u64,
    /// The effect at which the process dies, and whether after that effect took place.
    crash_at: Option<(u64, bool)>,
    /// Virtual time the last device call takes, set by the simulated kernel.
    delay: Option<Duration>,
    clock_ms: i64,
    /// Drives the yields at scheduling points.
    schedule: u64,
    /// Inside a blocking-pool call (`volumes::blocking`, run inline here).
    in_blocking: bool,
    /// Registry writes made on the runtime's own thread (not through the blocking pool): in
    /// ublkd one would hold one of the runtime's two threads for its fsyncs.
    inline_writes: Vec<String>,
}

thread_local! {
    static CTX: RefCell<Ctx> = RefCell::new(Ctx::default());
}

fn with<T>(f: impl FnOnce(&mut Ctx) -> T) -> T {
    CTX.with(|c| f(&mut c.borrow_mut()))
}

/// What happens to an effect the manager is about to make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// It takes place.
    Go,
    /// The process dies right now, before it takes place (a write torn by the crash).
    DiesNow,
    /// The process is dead: no effect.
    Dead,
}

/// Turns the simulation on for this thread (`on`), or off.
pub fn set_on(on: bool) {
    with(|c| {
        *c = Ctx {
            on,
            clock_ms: 1_000,
            ..Ctx::default()
        }
    });
}

pub fn on() -> bool {
    with(|c| c.on)
}

/// Runs `f` as the blocking pool would: registry writes inside it are where they belong.
pub fn in_blocking<T>(f: impl FnOnce() -> T) -> T {
    let was = with(|c| std::mem::replace(&mut c.in_blocking, true));
    let r = f();
    with(|c| c.in_blocking = was);
    r
}

/// A registry write (`what`) is about to happen: noted when it runs outside the blocking
/// pool while the simulation is on.
pub fn registry_write(what: &str) {
    with(|c| {
        if c.on && !c.in_blocking && !c.dead {
            c.inline_writes.push(what.to_owned());
        }
    })
}

/// The registry writes made on the runtime's own thread since the last call.
pub fn take_inline_writes() -> Vec<String> {
    with(|c| std::mem::take(&mut c.inline_writes))
}

/// Arms the process's death at effect `at` (counted from now), after it when `after`.
pub fn crash_at(at: Option<(u64, bool)>) {
    with(|c| {
        c.crash_at = at.map(|(n, after)| (c.effects + n, after));
        c.dead = false;
    });
}

pub fn dead() -> bool {
    with(|c| c.on && c.dead)
}

/// Counts one effect and says whether it takes place.
pub fn effect() -> Fate {
    with(|c| {
        if !c.on {
            return Fate::Go;
        }
        if c.dead {
            return Fate::Dead;
        }
        c.effects += 1;
        match c.crash_at {
            Some((n, after)) if n == c.effects => {
                c.dead = true;
                c.crash_at = None;
                if after {
                    Fate::Go
                } else {
                    Fate::DiesNow
                }
            }
            _ => Fate::Go,
        }
    })
}

pub fn set_delay(d: Duration) {
    with(|c| c.delay = Some(d));
}

/// Before a device call: a dead process never gets past here.
pub async fn checkpoint() {
    if dead() {
        std::future::pending::<()>().await;
    }
    tokio::task::yield_now().await;
    // Another call may have killed the process while this one yielded.
    if dead() {
        std::future::pending::<()>().await;
    }
}

/// After a device call: the time it took, then the same check.
pub async fn after_call() {
    if let Some(d) = with(|c| c.delay.take()) {
        tokio::time::sleep(d).await;
    }
    checkpoint().await;
}

/// Seeds the scheduling points' choices.
pub fn seed_schedule(seed: u64) {
    with(|c| c.schedule = seed | 1);
}

/// Where another task may run first (a lock about to be taken): yields 0 to 2 times, as the
/// seed says. Uncontended tokio locks never yield, so without this one thread runs each call
/// to its end and no interleaving is ever tried.
pub async fn schedule_point() {
    let n = with(|c| {
        if !c.on {
            return 0;
        }
        // xorshift64: the seed's own sequence.
        c.schedule ^= c.schedule << 13;
        c.schedule ^= c.schedule >> 7;
        c.schedule ^= c.schedule << 17;
        c.schedule % 3
    });
    for _ in 0..n {
        tokio::task::yield_now().await;
    }
}

/// The clock the manager stamps records with: one millisecond further at each reading.
pub fn now_ms() -> Option<i64> {
    with(|c| {
        c.on.then(|| {
            c.clock_ms += 1;
            c.clock_ms
        })
    })
}
