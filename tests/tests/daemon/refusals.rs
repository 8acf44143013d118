//! Bad requests get precise codes and change nothing.

use super::{
    api, create, ensure, file, guest, nvme, sample, spec, v1, Backend, Code, Daemon, Duration,
    Path, Result, MIB,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_precise_codes_and_change_nothing() -> Result<()> {
    let dir = guest::scratch("bad")?;
    let mut d = Daemon::new(
        &dir,
        19584,
        "[limits]\nmax_volume_size_bytes = 1073741824\nmax_volumes = 3\nmax_queue_depth = 1024\n",
    )?;
    d.start().await?;
    let mut c = d.volumes().await?;
    let root = d.root.clone();
    std::fs::write(root.join("used.img"), vec![0u8; (64 * MIB) as usize])?;
    std::fs::write(dir.join("outside.img"), vec![0u8; (64 * MIB) as usize])?;
    std::os::unix::fs::symlink(dir.join("outside.img"), root.join("escape.img"))?;
    // Two good volumes to collide with.
    c.create_volume(create("good", spec(64 * MIB, api::ram())))
        .await?;
    c.create_volume(create(
        "held",
        spec(64 * MIB, file(&root.join("used.img"), false)),
    ))
    .await?;
    let files_before = guest::sh(&format!(
        "find {} {} \\( -type f -o -type l \\) -printf '%p %s %T@ %l\\n' | sort",
        root.display(),
        d.state.display()
    ))?;

    let ram = api::ram;
    let ok = || spec(64 * MIB, ram());
    let with = |f: &dyn Fn(&mut v1::VolumeSpec)| {
        let mut s = ok();
        f(&mut s);
        s
    };
    let p = |s: &str| {
        Backend::File(v1::FileBackend {
            path: s.into(),
            create: true,
        })
    };
    let r = root.display().to_string();
    let creates: Vec<(&str, v1::CreateVolumeRequest, Code)> = vec![
        ("empty id", create("", ok()), Code::InvalidArgument),
        ("upper-case id", create("Vol", ok()), Code::InvalidArgument),
        (
            "id too long",
            create(&"a".repeat(64), ok()),
            Code::InvalidArgument,
        ),
        (
            "id with underscore",
            create("a_b", ok()),
            Code::InvalidArgument,
        ),
        (
            "id starting with dash",
            create("-a", ok()),
            Code::InvalidArgument,
        ),
        (
            "no spec",
            v1::CreateVolumeRequest {
                id: "x".into(),
                spec: None,
            },
            Code::InvalidArgument,
        ),
        (
            "size 0",
            create("x", with(&|s| s.size_bytes = 0)),
            Code::InvalidArgument,
        ),
        (
            "size unaligned",
            create("x", with(&|s| s.size_bytes = 4097)),
            Code::InvalidArgument,
        ),
        (
            "size over the limit",
            create("x", with(&|s| s.size_bytes = 2 << 30)),
            Code::InvalidArgument,
        ),
        (
            "block size 1024",
            create("x", with(&|s| s.block_size = Some(1024))),
            Code::InvalidArgument,
        ),
        (
            "no backend",
            create("x", with(&|s| s.backend = None)),
            Code::InvalidArgument,
        ),
        (
            "nvme device outside /dev",
            create("x", spec(64 * MIB, nvme("ng0n1", 0, 0))),
            Code::InvalidArgument,
        ),
        (
            "nvme device that is no NVMe namespace",
            create("x", spec(64 * MIB, nvme("/dev/null", 0, 0))),
            Code::InvalidArgument,
        ),
        (
            "nvme window past the namespace",
            create(
                "x",
                spec(64 * MIB, nvme("/dev/ng0n1", 1000 * MIB, 64 * MIB)),
            ),
            Code::InvalidArgument,
        ),
        (
            "relative path",
            create("x", spec(64 * MIB, p("rel.img"))),
            Code::InvalidArgument,
        ),
        (
            "path outside the roots",
            create("x", spec(64 * MIB, p("/etc/passwd"))),
            Code::PermissionDenied,
        ),
        (
            "path with ..",
            create("x", spec(64 * MIB, p(&format!("{r}/../outside.img")))),
            Code::InvalidArgument,
        ),
        (
            "symlink escaping the roots",
            create("x", spec(64 * MIB, p(&format!("{r}/escape.img")))),
            Code::PermissionDenied,
        ),
        (
            "missing file without create",
            create("x", spec(64 * MIB, file(&root.join("nope.img"), false))),
            Code::NotFound,
        ),
        (
            "missing directory",
            create("x", spec(64 * MIB, p(&format!("{r}/no/dir.img")))),
            Code::NotFound,
        ),
        (
            "queues 0",
            create("x", with(&|s| s.queues = Some(0))),
            Code::InvalidArgument,
        ),
        (
            "queues 1000",
            create("x", with(&|s| s.queues = Some(1000))),
            Code::InvalidArgument,
        ),
        (
            "depth 0",
            create("x", with(&|s| s.queue_depth = Some(0))),
            Code::InvalidArgument,
        ),
        (
            "depth over the limit",
            create("x", with(&|s| s.queue_depth = Some(2048))),
            Code::InvalidArgument,
        ),
        (
            "unknown io path",
            create("x", with(&|s| s.io_path = 7)),
            Code::InvalidArgument,
        ),
        (
            "duplicate id, other spec",
            create("good", with(&|s| s.size_bytes = 128 * MIB)),
            Code::AlreadyExists,
        ),
        (
            "backing file in use",
            create("x", spec(64 * MIB, file(&root.join("used.img"), false))),
            Code::FailedPrecondition,
        ),
    ];
    let mut n = 0;
    for (what, req, want) in creates {
        let err = c.create_volume(req).await.expect_err(what);
        assert_eq!(err.code(), want, "{what}: {err:?}");
        n += 1;
    }
    let del = |id: &str, allow_missing| v1::DeleteVolumeRequest {
        id: id.into(),
        allow_missing,
        delete_backing: false,
        force: false,
    };
    let e = c
        .delete_volume(del("unknown", false))
        .await
        .expect_err("delete unknown");
    assert_eq!(e.code(), Code::NotFound);
    c.delete_volume(del("unknown", true)).await?;
    let e = c
        .get_volume(v1::GetVolumeRequest {
            id: "unknown".into(),
        })
        .await
        .expect_err("get");
    assert_eq!(e.code(), Code::NotFound);
    let e = c
        .get_volume_stats(v1::GetVolumeStatsRequest {
            id: "unknown".into(),
        })
        .await
        .expect_err("stats");
    assert_eq!(e.code(), Code::NotFound);
    let resize = |id: &str, size| v1::ResizeVolumeRequest {
        id: id.into(),
        size_bytes: size,
    };
    let e = c
        .resize_volume(resize("unknown", 128 * MIB))
        .await
        .expect_err("resize unknown");
    assert_eq!(e.code(), Code::NotFound);
    let e = c
        .resize_volume(resize("good", 32 * MIB))
        .await
        .expect_err("shrink");
    assert_eq!(e.code(), Code::FailedPrecondition);
    let e = c
        .resize_volume(resize("good", 64 * MIB + 1))
        .await
        .expect_err("unaligned resize");
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = c
        .resize_volume(resize("held", 128 * MIB))
        .await
        .expect_err("grow past the file");
    assert_eq!(e.code(), Code::FailedPrecondition);
    n += 7;
    // A third volume fits, a fourth is over max_volumes.
    c.create_volume(create("third", ok())).await?;
    let e = c
        .create_volume(create("fourth", ok()))
        .await
        .expect_err("max volumes");
    assert_eq!(e.code(), Code::ResourceExhausted);
    c.delete_volume(del("third", false)).await?;
    // An oversized message and an expired deadline.
    let e = c
        .create_volume(create(&"a".repeat(2 << 20), ok()))
        .await
        .expect_err("oversized");
    assert_eq!(e.code(), Code::ResourceExhausted, "oversized: {e:?}");
    let refused = sample(
        &d.scrape()?,
        "ublkd_grpc_requests_total",
        &[("method", "CreateVolume"), ("code", "RESOURCE_EXHAUSTED")],
    );
    assert!(
        refused.unwrap_or(0.0) >= 2.0,
        "refused before a handler and still counted (with max_volumes): {refused:?}"
    );
    // A 100,000-character backing path: refused, and not echoed whole.
    let long = format!("{}/{}", root.display(), "p".repeat(100_000));
    let e = c
        .create_volume(create(
            "longpath",
            spec(64 * MIB, file(Path::new(&long), true)),
        ))
        .await
        .expect_err("a path longer than PATH_MAX");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().len() <= 1024,
        "bounded: {} bytes",
        e.message().len()
    );
    // Depth 1: the batch path refuses it, so auto takes per-IO; asking for batch is refused.
    let d1 = v1::VolumeSpec {
        queue_depth: Some(1),
        ..spec(16 * MIB, Backend::Null(v1::NullBackend {}))
    };
    let v = c
        .create_volume(create("d1", d1.clone()))
        .await?
        .into_inner();
    assert_eq!(v.io_path_in_use, v1::IoPath::PerIo as i32, "{v:?}");
    c.delete_volume(del("d1", false)).await?;
    let e = c
        .create_volume(create(
            "d1b",
            v1::VolumeSpec {
                io_path: v1::IoPath::Batch as i32,
                ..d1
            },
        ))
        .await
        .expect_err("batch at depth 1");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let mut req = tonic::Request::new(create("late", ok()));
    req.set_timeout(Duration::from_nanos(1));
    let e = c.create_volume(req).await.expect_err("expired deadline");
    assert!(
        matches!(e.code(), Code::DeadlineExceeded | Code::Cancelled),
        "deadline: {e:?}"
    );
    n += 4;
    ensure!(n >= 25, "at least 25 bad-input cases ({n})");

    // Still serving, nothing changed.
    let mut h = tonic_health::pb::health_client::HealthClient::new(d.channel().await?);
    let s = h
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await?;
    assert_eq!(s.into_inner().status, 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ids: Vec<String> = c
        .list_volumes(v1::ListVolumesRequest {})
        .await?
        .into_inner()
        .volumes
        .into_iter()
        .map(|v| v.id)
        .collect();
    assert_eq!(ids, ["good", "held"], "only the good volumes exist");
    let files_after = guest::sh(&format!(
        "find {} {} \\( -type f -o -type l \\) -printf '%p %s %T@ %l\\n' | sort",
        root.display(),
        d.state.display()
    ))?;
    assert_eq!(files_before, files_after, "no file changed");
    assert_eq!(std::fs::metadata(dir.join("outside.img"))?.len(), 64 * MIB);
    Ok(())
}
