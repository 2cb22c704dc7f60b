//! The Batch API's files in the store, on both backends: a file is
//! invisible until finished, read back part by part, scoped to its tenant,
//! listed in either order after a cursor, deleted with its parts, and
//! swept when abandoned or expired; the same on SQLite with the parts in a
//! directory (`batches.files_dir`), where they go with their rows.

use std::sync::Arc;

use super::super::{FileRecord, Order, Store};
use super::{Backend, T0, run};

fn file(tenant: &str, id: &str, created_at: i64) -> FileRecord {
    FileRecord {
        id: id.to_owned(),
        tenant: tenant.to_owned(),
        purpose: "batch".to_owned(),
        filename: format!("{id}.jsonl"),
        bytes: 0,
        lines: 0,
        created_at,
        expires_at: None,
    }
}

/// Writes `parts` as file `id` of `tenant` and finishes it.
async fn write(s: &dyn Store, tenant: &str, id: &str, created_at: i64, parts: &[&[u8]]) {
    let mut f = file(tenant, id, created_at);
    s.begin_file(&f).await.unwrap();
    for (n, part) in parts.iter().enumerate() {
        s.put_file_part(id, i32::try_from(n).unwrap(), part)
            .await
            .unwrap();
    }
    f.bytes = parts.iter().map(|p| p.len() as i64).sum();
    f.lines = 1;
    assert!(s.finish_file(&f).await.unwrap());
}

async fn ids(
    s: &dyn Store,
    tenant: &str,
    after: Option<&str>,
    order: Order,
    limit: u32,
) -> Vec<String> {
    s.list_files(tenant, None, after, order, limit)
        .await
        .unwrap()
        .into_iter()
        .map(|f| f.id)
        .collect()
}

async fn files_are_written_in_parts_and_read_back(s: Arc<dyn Store>) {
    let mut f = file("t1", "file-a", T0);
    s.begin_file(&f).await.unwrap();
    s.put_file_part("file-a", 0, b"{\"a\":1}\n").await.unwrap();
    // Invisible while it is being written.
    assert_eq!(s.file("t1", "file-a").await.unwrap(), None);
    assert!(ids(&*s, "t1", None, Order::Descending, 10).await.is_empty());
    s.put_file_part("file-a", 1, b"{\"b\":2}").await.unwrap();
    f.bytes = 15;
    f.lines = 2;
    f.expires_at = Some(T0 + 1_000);
    assert!(s.finish_file(&f).await.unwrap());
    assert_eq!(s.file("t1", "file-a").await.unwrap(), Some(f.clone()));
    // Finished once only.
    assert!(!s.finish_file(&f).await.unwrap());
    assert_eq!(
        s.file_part("file-a", 0).await.unwrap().as_deref(),
        Some(&b"{\"a\":1}\n"[..])
    );
    assert_eq!(
        s.file_part("file-a", 1).await.unwrap().as_deref(),
        Some(&b"{\"b\":2}"[..])
    );
    assert_eq!(s.file_part("file-a", 2).await.unwrap(), None);
    // Another tenant sees nothing of it and cannot delete it.
    assert_eq!(s.file("t2", "file-a").await.unwrap(), None);
    assert!(ids(&*s, "t2", None, Order::Descending, 10).await.is_empty());
    assert!(!s.delete_file("t2", "file-a").await.unwrap());
    assert!(s.file("t1", "file-a").await.unwrap().is_some());
    // Deleted with its parts.
    assert!(s.delete_file("t1", "file-a").await.unwrap());
    assert_eq!(s.file("t1", "file-a").await.unwrap(), None);
    assert_eq!(s.file_part("file-a", 0).await.unwrap(), None);
    assert!(!s.delete_file("t1", "file-a").await.unwrap());
}

async fn files_list_in_order_after_a_cursor(s: Arc<dyn Store>) {
    // Two files in the same millisecond: the id breaks the tie.
    write(&*s, "t1", "file-1", T0, &[b"x"]).await;
    write(&*s, "t1", "file-2", T0 + 1, &[b"x"]).await;
    write(&*s, "t1", "file-3", T0 + 1, &[b"x"]).await;
    write(&*s, "t1", "file-4", T0 + 2, &[b"x"]).await;
    write(&*s, "t2", "file-5", T0 + 3, &[b"x"]).await;
    assert_eq!(
        ids(&*s, "t1", None, Order::Descending, 10).await,
        ["file-4", "file-3", "file-2", "file-1"]
    );
    assert_eq!(
        ids(&*s, "t1", None, Order::Ascending, 10).await,
        ["file-1", "file-2", "file-3", "file-4"]
    );
    // Page by page, nothing skipped or repeated.
    assert_eq!(
        ids(&*s, "t1", None, Order::Descending, 2).await,
        ["file-4", "file-3"]
    );
    assert_eq!(
        ids(&*s, "t1", Some("file-3"), Order::Descending, 2).await,
        ["file-2", "file-1"]
    );
    assert!(
        ids(&*s, "t1", Some("file-1"), Order::Descending, 2)
            .await
            .is_empty()
    );
    assert_eq!(
        ids(&*s, "t1", Some("file-2"), Order::Ascending, 5).await,
        ["file-3", "file-4"]
    );
    // Another tenant's file is no cursor.
    assert!(
        ids(&*s, "t1", Some("file-5"), Order::Descending, 5)
            .await
            .is_empty()
    );
    // By purpose.
    let batch = s
        .list_files("t1", Some("batch"), None, Order::Ascending, 10)
        .await
        .unwrap();
    assert_eq!(batch.len(), 4);
    let output = s
        .list_files("t1", Some("batch_output"), None, Order::Ascending, 10)
        .await
        .unwrap();
    assert!(output.is_empty());
}

async fn files_abandoned_or_expired_are_swept(s: Arc<dyn Store>) {
    // An upload begun long ago and never finished, one begun just now, a
    // file past its expiry and one before it.
    s.begin_file(&file("t1", "file-old", T0)).await.unwrap();
    s.put_file_part("file-old", 0, b"x").await.unwrap();
    s.begin_file(&file("t1", "file-new", T0 + 10_000))
        .await
        .unwrap();
    let mut expired = file("t1", "file-expired", T0);
    s.begin_file(&expired).await.unwrap();
    s.put_file_part("file-expired", 0, b"x").await.unwrap();
    expired.expires_at = Some(T0 + 5_000);
    assert!(s.finish_file(&expired).await.unwrap());
    let mut kept = file("t1", "file-kept", T0);
    s.begin_file(&kept).await.unwrap();
    kept.expires_at = Some(T0 + 50_000);
    assert!(s.finish_file(&kept).await.unwrap());

    assert_eq!(s.sweep_files(T0 + 5_000, T0 + 10_000).await.unwrap(), 2);
    assert_eq!(s.file_part("file-old", 0).await.unwrap(), None);
    assert_eq!(s.file_part("file-expired", 0).await.unwrap(), None);
    assert_eq!(s.file("t1", "file-expired").await.unwrap(), None);
    assert!(s.file("t1", "file-kept").await.unwrap().is_some());
    // The upload still in progress can finish.
    let mut new = file("t1", "file-new", T0 + 10_000);
    new.bytes = 0;
    assert!(s.finish_file(&new).await.unwrap());
    assert_eq!(s.sweep_files(T0 + 5_000, T0 + 10_000).await.unwrap(), 0);
}

store_tests!(
    files_are_written_in_parts_and_read_back,
    files_list_in_order_after_a_cursor,
    files_abandoned_or_expired_are_swept,
);

/// The same on SQLite with the parts in a directory.
mod on_sqlite_with_a_files_dir {
    use std::path::PathBuf;
    use std::sync::Arc;

    use super::super::super::Store;
    use super::T0;

    async fn opened() -> (Arc<dyn Store>, PathBuf) {
        let root =
            std::env::temp_dir().join(format!("idem-files-dir-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&root).unwrap();
        let url = format!("sqlite://{}", root.join("idem.db").display());
        let s = crate::store::connect_with(&url, 4, Some(&root.join("parts")))
            .await
            .unwrap();
        (s, root)
    }

    #[tokio::test]
    async fn files_are_written_in_parts_and_read_back() {
        let (s, root) = opened().await;
        super::files_are_written_in_parts_and_read_back(s).await;
        let _ = std::fs::remove_dir_all(root);
    }

    #[tokio::test]
    async fn files_abandoned_or_expired_are_swept() {
        let (s, root) = opened().await;
        super::files_abandoned_or_expired_are_swept(s).await;
        assert!(!root.join("parts/file-old").exists(), "swept with its row");
        assert!(!root.join("parts/file-expired").exists());
        let _ = std::fs::remove_dir_all(root);
    }

    #[tokio::test]
    async fn the_parts_are_files_of_the_directory_and_go_with_their_row() {
        let (s, root) = opened().await;
        super::write(&*s, "t1", "file-d", T0, &[b"one\n", b"two\n"]).await;
        assert_eq!(
            std::fs::read(root.join("parts/file-d/1")).unwrap(),
            b"two\n"
        );
        assert_eq!(
            s.file_part("file-d", 0).await.unwrap().as_deref(),
            Some(&b"one\n"[..])
        );
        assert!(
            !s.delete_file("t2", "file-d").await.unwrap(),
            "another tenant's"
        );
        assert!(root.join("parts/file-d").exists());
        assert!(s.delete_file("t1", "file-d").await.unwrap());
        assert!(!root.join("parts/file-d").exists());
        // A file written before the directory was set is read from the
        // database.
        let url = format!("sqlite://{}", root.join("idem.db").display());
        let before = crate::store::connect(&url, 2).await.unwrap();
        super::write(&*before, "t1", "file-old", T0, &[b"kept\n"]).await;
        assert_eq!(
            s.file_part("file-old", 0).await.unwrap().as_deref(),
            Some(&b"kept\n"[..])
        );
        assert_eq!(s.file_part("file-old", 1).await.unwrap(), None);
        // An id that is not idem's names no directory.
        assert!(!s.delete_file("t1", "../idem.db").await.unwrap());
        assert!(root.join("idem.db").exists());
        let _ = std::fs::remove_dir_all(root);
    }
}
