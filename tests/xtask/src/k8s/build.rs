//! Go programs of the Kubernetes tier, built from their modules and cached by version.
//! `go install pkg@version` refuses a module whose go.mod has replace directives (Kubernetes
//! itself, the external-snapshotter) and asks the proxy for a module's version list (which it
//! refuses for some kubernetes-csi modules), so each one is built the way projects that import
//! such a module do: a small wrapper module, generated here, that requires it at its version,
//! restates its replace directives (for `k8s.io/kubernetes`: each staging module at its matching
//! `v0.x.y`), lists the commands as `tool` directives, `go mod tidy`, `go build`.
//! Cache layout (under `UBLKD_VM_CACHE`): `go/<name>@<version>/{src,bin}`; `bin/.complete`
//! marks a finished build.

use crate::apt;
use crate::gotools::go;
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

/// What `go mod download -json` says of `module@version` (downloaded first when it is not in
/// the module cache): its go.mod and source directory.
pub fn download(module: &str, version: &str) -> Result<(PathBuf, PathBuf)> {
    let at = format!("{module}@{version}");
    let out = apt::output_ok(Command::new(go()?).args(["mod", "download", "-json", &at]))?;
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
    let (module, version, name) = (b.module, b.version, b.name);
    let dir = crate::image::cache_dir().join(format!("go/{name}@{version}"));
    let bin = dir.join("bin");
    if bin.join(".complete").is_file() {
        return Ok(bin);
    }
    let started = std::time::Instant::now();
    let cached = dir.display();
    eprintln!("xtask: building {module}@{version} from its module (cached in {cached})");
    let (go_mod, _) = download(module, version)?;
    let text =
        fs::read_to_string(&go_mod).with_context(|| format!("reading {}", go_mod.display()))?;
    let (go_line, replaces) = parse_go_mod(&text);
    let go_version = go_line.as_deref().unwrap_or("1.24");
    let mut m = format!(
        "// Generated by cargo xtask k8s-test: builds {module} {version}.\n\
         module ublkd.test/{name}\n\ngo {go_version}\n\nrequire {module} {version}\n"
    );
    // A `replace (…)` or `tool (…)` block of lines joined by "\n\t", none where it has none.
    let block = |kind: &str, lines: String| match lines.as_str() {
        "" => String::new(),
        _ => format!("\n{kind} (\n\t{lines}\n)\n"),
    };
    let replaces = wrapper_replaces(b, &replaces)?;
    m.push_str(&block("replace", replaces.join("\n\t")));
    m.push_str(&block("tool", b.packages.join("\n\t")));
    let src = dir.join("src");
    crate::dist::empty_dir(&src)?;
    fs::write(src.join("go.mod"), m)?;
    apt::run_ok(Command::new(go()?).current_dir(&src).args(["mod", "tidy"]))
        .with_context(|| format!("go mod tidy for {module}@{version}"))?;
    crate::dist::empty_dir(&bin)?;
    go_build(&src, &ldflags(b), b.packages, &bin)
        .with_context(|| format!("go build of {module}@{version}"))?;
    fs::write(bin.join(".complete"), "")?;
    let secs = started.elapsed().as_secs_f64();
    eprintln!("xtask: {name}@{version} built in {secs:.0} s");
    Ok(bin)
}

/// `go build` of `packages` in the project's module `tests/k8s/<name>` into `out`, on every run
/// (Go's build cache makes a rebuild cheap): `standins` (the sandbox's pause process, and the
/// registrar and livenessprobe sidecars the module proxy does not serve) and `coredns` (the test
/// cluster's DNS server: CoreDNS from its module with the plugins a cluster's DNS needs).
pub fn local(ws: &Path, name: &str, packages: &str, out: &Path) -> Result<PathBuf> {
    let dir = ws.join("tests/k8s").join(name);
    go_build(&dir, "-s -w", &[packages], out)
        .with_context(|| format!("building {}", dir.display()))?;
    Ok(out.to_owned())
}

/// `go build` of `packages` in the module `dir` into the directory `out`, static, so that the
/// images need nothing but the binary.
fn go_build(dir: &Path, ldflags: &str, packages: &[&str], out: &Path) -> Result<()> {
    fs::create_dir_all(out)?;
    apt::run_ok(
        Command::new(go()?)
            .current_dir(dir)
            .env("CGO_ENABLED", "0")
            .args(["build", "-trimpath", "-ldflags", ldflags, "-o"])
            .arg(format!("{}/", out.display()))
            .args(packages),
    )
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
