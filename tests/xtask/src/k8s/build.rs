//! Go programs of the Kubernetes tier, built from their modules and cached by version.
//!
//! `go install pkg@version` refuses a module whose go.mod has replace directives (Kubernetes
//! itself, the external-snapshotter) and asks the proxy for a module's version list (which it
//! refuses for some kubernetes-csi modules), so each one is built the way projects that import
//! such a module do: a small wrapper module, generated here, that requires it at its version,
//! restates its replace directives (for `k8s.io/kubernetes`: each staging module at its matching
//! `v0.x.y`), lists the commands as `tool` directives, `go mod tidy`, `go build`.
//!
//! Cache layout (under `UBLKD_VM_CACHE`): `go/<name>@<version>/{src,bin}`; `bin/.complete`
//! marks a finished build.

use crate::apt;
use anyhow::{bail, Context, Result};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One module's commands to build.
#[derive(Debug, Clone, Copy)]
pub struct GoBuild {
    /// The cache key.
    pub name: &'static str,
    pub module: &'static str,
    pub version: &'static str,
    pub packages: &'static [&'static str],
}

/// Kubernetes 1.35, the last minor that supports containerd 1.x (Debian's): the control plane,
/// the kubelet, kube-proxy and kubectl, in one build (one module graph, one build cache).
pub const KUBERNETES: GoBuild = GoBuild {
    name: "kubernetes",
    module: "k8s.io/kubernetes",
    version: "v1.35.4",
    packages: &[
        "k8s.io/kubernetes/cmd/kube-apiserver",
        "k8s.io/kubernetes/cmd/kube-controller-manager",
        "k8s.io/kubernetes/cmd/kube-scheduler",
        "k8s.io/kubernetes/cmd/kubelet",
        "k8s.io/kubernetes/cmd/kube-proxy",
        "k8s.io/kubernetes/cmd/kubectl",
    ],
};

/// The kubernetes-csi sidecars and the snapshot controller the manifests name, at the
/// versions the module proxy serves (the closing note of issue 23 says which differ from the
/// manifests' pins, and why).
pub const SIDECARS: &[GoBuild] = &[
    GoBuild {
        name: "external-provisioner",
        module: "github.com/kubernetes-csi/external-provisioner/v5",
        version: "v5.3.0",
        packages: &["github.com/kubernetes-csi/external-provisioner/v5/cmd/csi-provisioner"],
    },
    GoBuild {
        name: "external-snapshotter",
        module: "github.com/kubernetes-csi/external-snapshotter/v8",
        version: "v8.2.1",
        packages: &[
            "github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter",
            "github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller",
        ],
    },
    GoBuild {
        name: "external-resizer",
        module: "github.com/kubernetes-csi/external-resizer",
        version: "v1.14.0",
        packages: &["github.com/kubernetes-csi/external-resizer/cmd/csi-resizer"],
    },
];

fn go() -> Result<PathBuf> {
    crate::gotools::go()
}

/// What `go mod download -json` says of `module@version`: its go.mod and source directory.
fn download(module: &str, version: &str) -> Result<(PathBuf, PathBuf)> {
    let out = apt::output_ok(Command::new(go()?).args([
        "mod",
        "download",
        "-json",
        &format!("{module}@{version}"),
    ]))?;
    let v: serde_json::Value = serde_json::from_str(&out)
        .with_context(|| format!("go mod download -json {module}@{version}: {out}"))?;
    if let Some(e) = v["Error"].as_str() {
        bail!("the module proxy refused {module}@{version}: {e}");
    }
    let field = |k: &str| -> Result<PathBuf> {
        Ok(PathBuf::from(v[k].as_str().with_context(|| {
            format!("go mod download gave no {k} for {module}")
        })?))
    };
    Ok((field("GoMod")?, field("Dir")?))
}

/// The snapshot CRDs: external-snapshotter's client module, at the version its v8.2.1
/// requires (`config/crd` in it).
pub const SNAPSHOT_CLIENT: (&str, &str) = (
    "github.com/kubernetes-csi/external-snapshotter/client/v8",
    "v8.2.0",
);

/// A module's source directory in the module cache, downloaded first when it is not there:
/// the cluster add-ons' manifests are read from it, as a user reads them from the release.
pub fn module_dir(module: &str, version: &str) -> Result<PathBuf> {
    Ok(download(module, version)?.1)
}

/// The `go` line and the replace directives of a go.mod, each replace as `old => new`.
fn parse_go_mod(text: &str) -> (Option<String>, Vec<String>) {
    let mut go_line = None;
    let mut replaces = Vec::new();
    let mut in_block = false;
    for raw in text.lines() {
        let line = raw.split("//").next().unwrap_or("").trim();
        if in_block {
            if line == ")" {
                in_block = false;
            } else if !line.is_empty() {
                replaces.push(line.to_owned());
            }
            continue;
        }
        if let Some(v) = line.strip_prefix("go ") {
            go_line = Some(v.trim().to_owned());
        } else if line == "replace (" {
            in_block = true;
        } else if let Some(r) = line.strip_prefix("replace ") {
            replaces.push(r.trim().to_owned());
        }
    }
    (go_line, replaces)
}

/// The wrapper's replace directives: in Kubernetes, a replace into its own tree
/// (`=> ./staging/…`, the staging modules) becomes the published module at the matching
/// `v0.x.y`; elsewhere such a replace is dropped; any other replace is restated as it is.
fn wrapper_replaces(b: &GoBuild, replaces: &[String]) -> Result<Vec<String>> {
    let staging_version = || -> Result<String> {
        let rest = b
            .version
            .strip_prefix("v1.")
            .with_context(|| format!("{} {} is not a v1.x.y", b.module, b.version))?;
        Ok(format!("v0.{rest}"))
    };
    let mut out = Vec::new();
    for r in replaces {
        let Some((old, new)) = r.split_once("=>") else {
            bail!("unreadable replace directive in {}: {r}", b.module);
        };
        let (old, new) = (old.trim(), new.trim());
        let old_path = old.split_whitespace().next().unwrap_or(old);
        if new.starts_with("./") || new.starts_with("../") {
            if b.module == KUBERNETES.module {
                out.push(format!("{old_path} => {old_path} {}", staging_version()?));
            }
            // Elsewhere a replace into the module's own tree points at a nested module, which
            // the module also requires at a published version: that one is used.
        } else {
            out.push(format!("{old} => {new}"));
        }
    }
    Ok(out)
}

fn ldflags(b: &GoBuild) -> String {
    let mut flags = String::from("-s -w");
    if b.module == KUBERNETES.module {
        // What hack/lib/version.sh sets, so that the skew checks see a real version.
        let minor = b.version.split('.').nth(1).unwrap_or("0");
        for p in [
            "k8s.io/component-base/version",
            "k8s.io/client-go/pkg/version",
        ] {
            flags.push_str(&format!(
                " -X {p}.gitVersion={v} -X {p}.gitMajor=1 -X {p}.gitMinor={minor} \
                 -X {p}.gitTreeState=clean -X {p}.buildDate=1970-01-01T00:00:00Z",
                v = b.version
            ));
        }
    } else {
        flags.push_str(&format!(" -X main.version={}", b.version));
    }
    flags
}

/// The directory holding `b`'s binaries, built first when this version is not cached yet.
pub fn ensure(b: &GoBuild) -> Result<PathBuf> {
    let dir = crate::image::cache_dir()
        .join("go")
        .join(format!("{}@{}", b.name, b.version));
    let bin = dir.join("bin");
    if bin.join(".complete").is_file() {
        return Ok(bin);
    }
    let started = std::time::Instant::now();
    eprintln!(
        "xtask: building {}@{} from its module (cached in {})",
        b.module,
        b.version,
        dir.display()
    );
    let (go_mod, _) = download(b.module, b.version)?;
    let text =
        fs::read_to_string(&go_mod).with_context(|| format!("reading {}", go_mod.display()))?;
    let (go_line, replaces) = parse_go_mod(&text);
    let mut m = format!(
        "// Generated by cargo xtask k8s-test: builds {} {}.\nmodule ublkd.test/{}\n\ngo {}\n\nrequire {} {}\n",
        b.module,
        b.version,
        b.name,
        go_line.as_deref().unwrap_or("1.24"),
        b.module,
        b.version
    );
    let reps = wrapper_replaces(b, &replaces)?;
    if !reps.is_empty() {
        m.push_str("\nreplace (\n");
        for r in reps {
            m.push_str(&format!("\t{r}\n"));
        }
        m.push_str(")\n");
    }
    m.push_str("\ntool (\n");
    for p in b.packages {
        m.push_str(&format!("\t{p}\n"));
    }
    m.push_str(")\n");
    let src = dir.join("src");
    if src.exists() {
        fs::remove_dir_all(&src)?;
    }
    fs::create_dir_all(&src)?;
    fs::write(src.join("go.mod"), m)?;
    apt::run_ok(Command::new(go()?).current_dir(&src).args(["mod", "tidy"]))
        .with_context(|| format!("go mod tidy for {}@{}", b.module, b.version))?;
    if bin.exists() {
        fs::remove_dir_all(&bin)?;
    }
    fs::create_dir_all(&bin)?;
    let mut cmd = Command::new(go()?);
    cmd.current_dir(&src)
        // Static, so the images need nothing but the binary.
        .env("CGO_ENABLED", "0")
        .args(["build", "-trimpath", "-ldflags", &ldflags(b), "-o"])
        .arg(format!("{}/", bin.display()))
        .args(b.packages);
    apt::run_ok(&mut cmd).with_context(|| format!("go build of {}@{}", b.module, b.version))?;
    fs::write(bin.join(".complete"), "")?;
    eprintln!(
        "xtask: {}@{} built in {:.0} s",
        b.name,
        b.version,
        started.elapsed().as_secs_f64()
    );
    Ok(bin)
}

/// The project's own stand-ins (tests/k8s/standins): the sandbox's pause process, and the
/// registrar and livenessprobe sidecars the module proxy does not serve. Go's build cache makes
/// a rebuild cheap, so they are built on every run, into `out`.
pub fn standins(ws: &Path, out: &Path) -> Result<PathBuf> {
    local_module(&ws.join("tests/k8s/standins"), "./cmd/...", out)
}

/// The test cluster's DNS server (tests/k8s/coredns: CoreDNS from its module with the plugins a
/// cluster's DNS needs), built like the stand-ins; the path of the binary.
pub fn coredns(ws: &Path, out: &Path) -> Result<PathBuf> {
    local_module(&ws.join("tests/k8s/coredns"), ".", out)?;
    Ok(out.join("coredns"))
}

/// `go build` of `packages` in the project's module `dir`, static, into `out`.
fn local_module(dir: &Path, packages: &str, out: &Path) -> Result<PathBuf> {
    fs::create_dir_all(out)?;
    let mut cmd = Command::new(go()?);
    cmd.current_dir(dir)
        .env("CGO_ENABLED", "0")
        .args(["build", "-trimpath", "-ldflags", "-s -w", "-o"])
        .arg(format!("{}/", out.display()))
        .arg(packages);
    apt::run_ok(&mut cmd).with_context(|| format!("building {}", dir.display()))?;
    Ok(out.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_replaces_become_published_modules_and_others_stay() {
        let text = "module k8s.io/kubernetes\n\ngo 1.25.0\n\nreplace (\n\tk8s.io/api => ./staging/src/k8s.io/api\n\tk8s.io/kubelet => ./staging/src/k8s.io/kubelet // staged\n)\nreplace github.com/a/b v1.0.0 => github.com/c/b v1.0.1\n";
        let (go_line, reps) = parse_go_mod(text);
        assert_eq!(go_line.as_deref(), Some("1.25.0"));
        let nested = wrapper_replaces(&SIDECARS[1], &reps).unwrap();
        assert_eq!(
            nested,
            vec!["github.com/a/b v1.0.0 => github.com/c/b v1.0.1"]
        );
        let out = wrapper_replaces(&KUBERNETES, &reps).unwrap();
        assert_eq!(
            out,
            vec![
                "k8s.io/api => k8s.io/api v0.35.4",
                "k8s.io/kubelet => k8s.io/kubelet v0.35.4",
                "github.com/a/b v1.0.0 => github.com/c/b v1.0.1",
            ]
        );
    }

    #[test]
    fn kubernetes_gets_its_version_in_ldflags() {
        let f = ldflags(&KUBERNETES);
        assert!(f.contains("k8s.io/component-base/version.gitVersion=v1.35.4"));
        assert!(f.contains("gitMinor=35"));
        assert!(ldflags(&SIDECARS[0]).contains("main.version=v5.3.0"));
    }
}
