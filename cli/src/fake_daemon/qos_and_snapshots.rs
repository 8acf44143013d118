//! `set-qos` and the snapshot commands against the fake daemon: the merge over a volume's
//! current limits, `--clear`, and snapshots taken, listed, cloned from and deleted.

use clap::Parser;

use super::{run, serve};
use crate::args::Cli;

#[tokio::test]
async fn set_qos_merges_over_the_volumes_limits() {
    let (fake, sock) = serve(Vec::new());
    run(
        &sock,
        &[
            "create-volume",
            "vol-1",
            "--size",
            "1GiB",
            "--backend",
            "ram",
            "--read-iops",
            "5000",
            "--write-bw",
            "100MiB/s",
        ],
    )
    .await
    .unwrap();
    let out = run(&sock, &["get-volume", "vol-1"]).await.unwrap();
    assert!(
        out.contains("\nqos:         read 5000 IOPS, write 100 MiB/s, burst 100 ms\n"),
        "{out}"
    );
    let out = run(&sock, &["list-volumes", "--no-headers"]).await.unwrap();
    assert!(out.ends_with("  read 5000 IOPS, write 100 MiB/s"), "{out}");
    let out = run(&sock, &["stats", "vol-1"]).await.unwrap();
    assert!(
        out.ends_with("\nthrottled:    3 requests, 250.0 ms waited"),
        "{out}"
    );

    // Only the write bandwidth changes; the read IOPS limit stays.
    let out = run(&sock, &["set-qos", "vol-1", "--write-bw", "200MiB/s"])
        .await
        .unwrap();
    assert!(
        out.contains("\nqos:         read 5000 IOPS, write 200 MiB/s, burst 100 ms\n"),
        "{out}"
    );

    let out = run(
        &sock,
        &[
            "set-qos",
            "vol-1",
            "--read-iops",
            "unlimited",
            "--write-iops",
            "800",
            "--burst",
            "2s",
            "-o",
            "json",
        ],
    )
    .await
    .unwrap();
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        json["spec"]["qos"],
        serde_json::json!({
            "read_iops": 0,
            "write_iops": 800,
            "read_bytes_per_second": 0,
            "write_bytes_per_second": 200u64 << 20,
            "burst_ms": 2000,
        })
    );

    let out = run(&sock, &["set-qos", "vol-1", "--clear"]).await.unwrap();
    assert!(out.contains("\nqos:         unlimited\n"), "{out}");
    let sent = fake.qos_set.lock().unwrap().clone().unwrap();
    assert_eq!((sent.id.as_str(), sent.qos), ("vol-1", None));
    let out = run(&sock, &["get-volume", "vol-1", "-o", "json"])
        .await
        .unwrap();
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(json["spec"].get("qos").is_none(), "{json}");
    let out = run(&sock, &["stats", "vol-1"]).await.unwrap();
    assert!(out.ends_with("\nthrottled:    0 requests"), "{out}");

    // After --clear, a flag starts a new set from nothing.
    let out = run(&sock, &["set-qos", "vol-1", "--read-bw", "1Gi"])
        .await
        .unwrap();
    assert!(
        out.contains("\nqos:         read 1 GiB/s, burst 100 ms\n"),
        "{out}"
    );

    let err = run(&sock, &["set-qos", "vol-9", "--clear"])
        .await
        .unwrap_err();
    assert_eq!(err.exit_code(), 1);
    assert_eq!(
        err.to_string(),
        "not found: volume \"vol-9\" does not exist"
    );
    let err = Cli::try_parse_from(["ublkctl", "set-qos", "vol-1"]).unwrap_err();
    assert_eq!(err.exit_code(), 2);
    let _ = std::fs::remove_file(&sock);
}

#[tokio::test]
async fn snapshots_against_a_fake_daemon() {
    let (_fake, sock) = serve(Vec::new());
    run(
        &sock,
        &[
            "create-volume",
            "db",
            "--size",
            "1GiB",
            "--backend",
            "file+create:/srv/db.img",
        ],
    )
    .await
    .unwrap();

    let out = run(&sock, &["create-snapshot", "s1", "--volume", "db"])
        .await
        .unwrap();
    let expected = "\
id:      s1
volume:  db
size:    1 GiB (1073741824 bytes)
created: 2023-11-14T22:13:20Z
path:    /srv/db.img.snap-s1
ready:   yes";
    assert_eq!(out, expected);
    // Idempotent by id.
    let again = run(&sock, &["create-snapshot", "s1", "--volume", "db"])
        .await
        .unwrap();
    assert_eq!(again, expected);

    let out = run(
        &sock,
        &["create-snapshot", "s2", "--volume", "db", "-o", "json"],
    )
    .await
    .unwrap();
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["id"], "s2");
    assert_eq!(json["source_volume_id"], "db");
    assert_eq!(json["size_bytes"], 1u64 << 30);
    assert_eq!(json["path"], "/srv/db.img.snap-s2");
    assert_eq!(json["ready"], true);

    let out = run(&sock, &["list-snapshots"]).await.unwrap();
    assert_eq!(
        out,
        "\
ID  VOLUME  SIZE   CREATED               PATH
s1  db      1 GiB  2023-11-14T22:13:20Z  /srv/db.img.snap-s1
s2  db      1 GiB  2023-11-14T22:13:21Z  /srv/db.img.snap-s2"
    );
    let out = run(&sock, &["list-snapshots", "--volume", "other"])
        .await
        .unwrap();
    assert_eq!(out, "ID  VOLUME  SIZE  CREATED  PATH");
    let out = run(&sock, &["list-snapshots", "-o", "yaml"]).await.unwrap();
    assert!(
        out.starts_with("snapshots:\n  - created: \"2023-11-14T22:13:20Z\"\n    id: \"s1\""),
        "{out}"
    );

    // A clone from a snapshot: the source travels in the spec.
    let out = run(
        &sock,
        &[
            "create-volume",
            "db-copy",
            "--size",
            "2GiB",
            "--backend",
            "file:/srv/db-copy.img",
            "--from-snapshot",
            "s1",
            "-o",
            "json",
        ],
    )
    .await
    .unwrap();
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["spec"]["from_snapshot"], "s1");
    let out = run(&sock, &["get-volume", "db-copy"]).await.unwrap();
    assert!(out.ends_with("\nsource:      snapshot s1"), "{out}");
    let err = run(
        &sock,
        &[
            "create-volume",
            "small",
            "--size",
            "512MiB",
            "--backend",
            "file:/srv/small.img",
            "--from-snapshot",
            "s1",
        ],
    )
    .await
    .unwrap_err();
    assert_eq!(err.exit_code(), 1);
    assert!(
        err.to_string().starts_with("invalid argument: size_bytes"),
        "{err}"
    );
    let err = run(
        &sock,
        &[
            "create-volume",
            "c",
            "--size",
            "1GiB",
            "--backend",
            "file:/srv/c.img",
            "--from-volume",
            "gone",
        ],
    )
    .await
    .unwrap_err();
    assert_eq!(err.to_string(), "not found: volume \"gone\" does not exist");

    let out = run(&sock, &["delete-snapshot", "s1"]).await.unwrap();
    assert_eq!(out, "deleted snapshot \"s1\"");
    let err = run(&sock, &["delete-snapshot", "s1"]).await.unwrap_err();
    assert_eq!(err.exit_code(), 1);
    assert_eq!(err.to_string(), "not found: snapshot \"s1\" does not exist");
    let out = run(
        &sock,
        &["delete-snapshot", "s1", "--allow-missing", "-o", "json"],
    )
    .await
    .unwrap();
    assert_eq!(out, "{}");
    let out = run(&sock, &["list-snapshots", "--no-headers"])
        .await
        .unwrap();
    // Columns keep the header's width, as every table does.
    assert_eq!(
        out,
        "s2  db      1 GiB  2023-11-14T22:13:21Z  /srv/db.img.snap-s2"
    );

    // Snapshots are of file volumes.
    run(
        &sock,
        &[
            "create-volume",
            "scratch",
            "--size",
            "1GiB",
            "--backend",
            "ram",
        ],
    )
    .await
    .unwrap();
    let err = run(&sock, &["create-snapshot", "s3", "--volume", "scratch"])
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "failed precondition: volume \"scratch\" is not a file volume"
    );
    let _ = std::fs::remove_file(&sock);
}
