//! The guest's kernel and initramfs, built once and cached by kernel version.
//! Cache layout (`UBLKD_VM_CACHE`, default `~/.cache/ublkd-vm`):
//! - `apt/`                    private apt lists for the kernel suites
//! - `kernel.resolved`         the kernel version chosen and when (re-resolved weekly)
//! - `kernel/<kver>/root/`     the extracted Debian packages (vmlinuz, modules, config)
//! - `kernel/<kver>/initramfs-<hash>.cpio`  busybox + decompressed modules + /init

use crate::apt::{self, PrivateApt};
use crate::cpio;
use anyhow::{bail, Context, Result};
use std::collections::hash_map::DefaultHasher;
use std::fs;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Oldest kernel accepted: BATCH_IO, AUTO_BUF_REG and ublk commands on IOPOLL rings.
const KERNEL_MIN: &[u64] = &[7, 1];
/// Modules loaded at boot, each with its dependencies.
const MODULES: &[&str] = &[
    "9pnet_virtio",
    "9p",
    "ublk_drv",
    "nvme",
    "null_blk",
    "loop",
    "ext4",
    // The CSI driver makes and grows xfs as well as ext4.
    "xfs",
    // The writable root of the Kubernetes tier (`ublkd.overlay=1`).
    "overlay",
    // Encrypted volumes: dm-crypt with aes-xts, and the kernel crypto API cryptsetup uses for
    // LUKS2 keyslots (the guest loads no module on demand).
    "dm_crypt",
    "xts",
    // AES-NI (offered by `-cpu max` too): aes-xts as hosts run it, not the table-driven C
    "aesni_intel",
    "algif_skcipher",
    "algif_hash",
];
const RESOLVE_EVERY: Duration = Duration::from_secs(7 * 24 * 3600);
const INIT: &str = include_str!("init.sh");

/// A bootable guest: kernel image and initramfs.
#[derive(Debug, Clone)]
pub struct Kernel {
    pub kver: String,
    pub vmlinuz: PathBuf,
    pub initramfs: PathBuf,
    pub cache: PathBuf,
}

pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("UBLKD_VM_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/ublkd-vm")
}

/// Host tools, kernel and initramfs, all ready to boot. A warm cache downloads nothing.
pub fn prepare(_ws: &Path) -> Result<Kernel> {
    apt::ensure_host_tools()?;
    let cache = cache_dir();
    fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let kver = resolve_kernel(&cache)?;
    let kdir = cache.join("kernel").join(&kver);
    let root = kdir.join("root");
    let vmlinuz = find_kernel_file(&root, &kver, "vmlinuz")
        .with_context(|| format!("no vmlinuz for {kver} under {}", root.display()))?;
    let initramfs = build_initramfs(&kdir, &root, &kver)?;
    Ok(Kernel {
        kver,
        vmlinuz,
        initramfs,
        cache,
    })
}

fn resolve_kernel(cache: &Path) -> Result<String> {
    if let Ok(kver) = std::env::var("UBLKD_VM_KVER") {
        let apt = PrivateApt::new(&cache.join("apt"))?;
        ensure_extracted(cache, &apt, &kver, true)?;
        return Ok(kver);
    }
    let marker = cache.join("kernel.resolved");
    let refresh = std::env::var("UBLKD_VM_REFRESH").is_ok_and(|v| v == "1");
    let fresh = !refresh && apt::modified_within(&marker, RESOLVE_EVERY);
    let resolved = fs::read_to_string(&marker).map(|k| k.trim().to_owned());
    if let Some(kver) = resolved.ok().filter(|k| fresh && is_extracted(cache, k)) {
        return Ok(kver);
    }
    let apt = PrivateApt::new(&cache.join("apt"))?;
    apt.update()?;
    let mut candidates: Vec<String> = apt
        .search_names("^linux-(binary|image)-[0-9][^ ]*-amd64$")?
        .into_iter()
        .filter_map(|p| {
            p.strip_prefix("linux-binary-")
                .or_else(|| p.strip_prefix("linux-image-"))
                .map(str::to_owned)
        })
        // The generic flavour only: not -rt-amd64, -cloud-amd64, ...
        .filter(|k| {
            k.strip_suffix("-amd64")
                .is_some_and(|v| !v.contains("-rt") && !v.contains("-cloud"))
        })
        .filter(|k| apt::kver_numbers(k).as_slice() >= KERNEL_MIN)
        .collect();
    candidates.sort_by_key(|k| std::cmp::Reverse(apt::kver_numbers(k)));
    candidates.dedup();
    if candidates.is_empty() {
        bail!("no Debian kernel >= 7.1 found in the kernel suites");
    }
    for kver in &candidates {
        match ensure_extracted(cache, &apt, kver, false) {
            Ok(()) => {
                fs::write(&marker, format!("{kver}\n"))?;
                eprintln!("xtask: guest kernel {kver}");
                return Ok(kver.clone());
            }
            Err(e) => eprintln!("xtask: skipping kernel {kver}: {e:#}"),
        }
    }
    bail!("none of the kernels {candidates:?} ships ublk_drv and nvme")
}

fn is_extracted(cache: &Path, kver: &str) -> bool {
    cache.join("kernel").join(kver).join("ready").exists()
}

/// Downloads and extracts the kernel packages for `kver`, checking its config first.
fn ensure_extracted(cache: &Path, apt: &PrivateApt, kver: &str, update: bool) -> Result<()> {
    if is_extracted(cache, kver) {
        return Ok(());
    }
    if update {
        apt.update()?;
    }
    let kdir = cache.join("kernel").join(kver);
    let debs = kdir.join("debs");
    let root = kdir.join("root");
    let _ = fs::remove_dir_all(&kdir);
    fs::create_dir_all(&root)?;
    let new_layout = !apt.versions(&format!("linux-binary-{kver}"))?.is_empty();
    let kinds: &[&str] = match new_layout {
        true => &["binary", "modules", "base"],
        false => &["image"],
    };
    let packages: Vec<String> = kinds.iter().map(|p| format!("linux-{p}-{kver}")).collect();
    // The config decides whether this kernel is any use; fetch the small package holding it first.
    let config_pkg = packages.last().cloned().unwrap_or_default();
    apt.download(std::slice::from_ref(&config_pkg), &debs)?;
    apt::extract_debs(&debs, &root)?;
    fs::remove_dir_all(&debs)?;
    let config = find_kernel_file(&root, kver, "config").context("kernel config not found")?;
    let config = fs::read_to_string(&config)?;
    for option in ["CONFIG_BLK_DEV_UBLK", "CONFIG_BLK_DEV_NVME"] {
        let set = |l: &str| matches!(l.strip_prefix(option), Some("=m" | "=y"));
        if !config.lines().any(set) {
            bail!("{option} is not enabled");
        }
    }
    let rest: Vec<String> = packages.into_iter().filter(|p| *p != config_pkg).collect();
    if !rest.is_empty() {
        apt.download(&rest, &debs)?;
        apt::extract_debs(&debs, &root)?;
        fs::remove_dir_all(&debs)?;
    }
    find_kernel_file(&root, kver, "vmlinuz").context("no vmlinuz in the kernel packages")?;
    eprintln!("xtask: indexing modules of {kver}");
    let base = modules_base(&root, kver);
    apt::run_ok(Command::new("depmod").arg("-b").arg(base).arg(kver))?;
    fs::write(kdir.join("ready"), "")?;
    Ok(())
}

/// The directory that holds `lib/modules/<kver>`: `root/usr` for the new layout, `root` for the old.
fn modules_base(root: &Path, kver: &str) -> PathBuf {
    if root.join("usr/lib/modules").join(kver).exists() {
        root.join("usr")
    } else {
        root.to_path_buf()
    }
}

/// The kernel's `name` (`vmlinuz`, `config`): beside its modules in the new layout, in /boot
/// in the old.
fn find_kernel_file(root: &Path, kver: &str, name: &str) -> Option<PathBuf> {
    [
        root.join("usr/lib/modules").join(kver).join(name),
        root.join("boot").join(format!("{name}-{kver}")),
    ]
    .into_iter()
    .find(|p| p.exists())
}

/// Module files to load, in dependency order, deduplicated.
fn module_order(root: &Path, kver: &str) -> Result<Vec<PathBuf>> {
    let base = modules_base(root, kver);
    let mut order: Vec<PathBuf> = Vec::new();
    for m in MODULES {
        let mut modprobe = Command::new("modprobe");
        modprobe.arg("-d").arg(&base);
        let out = apt::output_ok(modprobe.args(["-S", kver, "--show-depends", m]))?;
        for line in out.lines() {
            if let Some(path) = line.strip_prefix("insmod ") {
                let path = PathBuf::from(path.trim());
                if !order.contains(&path) {
                    order.push(path);
                }
            }
        }
    }
    Ok(order)
}

fn build_initramfs(kdir: &Path, root: &Path, kver: &str) -> Result<PathBuf> {
    let busybox = apt::which("busybox").context("busybox not found")?;
    let modules = module_order(root, kver)?;
    let mut h = DefaultHasher::new();
    INIT.hash(&mut h);
    modules.hash(&mut h);
    fs::metadata(&busybox)?.len().hash(&mut h);
    let out = kdir.join(format!("initramfs-{:016x}.cpio", h.finish()));
    if out.exists() {
        return Ok(out);
    }
    eprintln!("xtask: building initramfs for {kver}");
    let mut a = cpio::Archive::default();
    for d in ["bin", "dev", "proc", "sys", "lib", "newroot", "tmp"] {
        a.dir(d);
    }
    a.dir("lib/modules");
    a.file("bin/busybox", 0o755, &fs::read(&busybox)?);
    a.file("init", 0o755, INIT.as_bytes());
    let mut names = Vec::new();
    for path in &modules {
        let file = path
            .file_name()
            .and_then(|n| n.to_str())
            .context("odd module file name")?;
        let compressed = [(".xz", "xz"), (".zst", "zstd")]
            .into_iter()
            .find_map(|(ext, tool)| Some((file.strip_suffix(ext)?, tool)));
        let (name, data) = match compressed {
            Some((stem, tool)) => {
                let out = Command::new(tool).arg("-dc").arg(path).output();
                (stem, out.with_context(|| format!("running {tool}"))?.stdout)
            }
            None => (file, fs::read(path)?),
        };
        if data.is_empty() {
            bail!("could not decompress {}", path.display());
        }
        a.file(&format!("lib/modules/{name}"), 0o644, &data);
        names.push(name);
    }
    a.file("modules.order", 0o644, (names.join("\n") + "\n").as_bytes());
    let tmp = out.with_extension("tmp");
    let mut f = fs::File::create(&tmp)?;
    a.finish(&mut f)?;
    f.sync_all()?;
    fs::rename(&tmp, &out)?;
    Ok(out)
}
