//! A directory that holds the files' parts instead of the database
//! (`batches.files_dir`, SQLite only): one subdirectory per file, one file
//! per part. The rows stay in the database, which still decides what
//! exists: a part is only read for a file whose row was found, and a
//! file's directory goes when its row does.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use tokio::io::AsyncWriteExt;

use super::{Result, StoreError};

/// Where the parts of files live.
#[derive(Debug, Clone)]
pub struct PartsDir(PathBuf);

fn io(e: std::io::Error) -> StoreError {
    StoreError::Files(e)
}

impl PartsDir {
    pub fn new(dir: PathBuf) -> PartsDir {
        PartsDir(dir)
    }

    /// The directory of file `id`. Ids are idem's own (`file-<hex>`);
    /// anything else names no directory, so no id reaches outside.
    fn of(&self, id: &str) -> Result<PathBuf> {
        let safe = !id.is_empty()
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !safe {
            return Err(StoreError::Corrupt(format!("not a file id: {id:?}")));
        }
        Ok(self.0.join(id))
    }

    /// Writes part `n` of file `id` whole, then renames it into place:
    /// a part is there entirely or not at all.
    pub async fn put(&self, id: &str, n: i32, data: &[u8]) -> Result<()> {
        let dir = self.of(id)?;
        tokio::fs::create_dir_all(&dir).await.map_err(io)?;
        let part = dir.join(n.to_string());
        let partial = dir.join(format!("{n}.partial"));
        let mut f = tokio::fs::File::create(&partial).await.map_err(io)?;
        f.write_all(data).await.map_err(io)?;
        f.sync_data().await.map_err(io)?;
        drop(f);
        tokio::fs::rename(&partial, &part).await.map_err(io)?;
        Ok(())
    }

    /// Part `n` of file `id`, if it was written.
    pub async fn get(&self, id: &str, n: i32) -> Result<Option<Vec<u8>>> {
        match tokio::fs::read(self.of(id)?.join(n.to_string())).await {
            Ok(data) => Ok(Some(data)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io(e)),
        }
    }

    /// Removes file `id`'s parts (none written: nothing to do).
    pub async fn remove(&self, id: &str) -> Result<()> {
        match tokio::fs::remove_dir_all(self.of(id)?).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(e)),
        }
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn parts_are_written_read_and_removed_and_no_id_escapes() {
        let tmp =
            std::env::temp_dir().join(format!("idem-parts-{}", uuid::Uuid::now_v7().simple()));
        let dir = PartsDir::new(tmp.join("parts"));
        dir.put("file-abc", 0, b"first").await.unwrap();
        dir.put("file-abc", 1, b"second").await.unwrap();
        assert_eq!(
            dir.get("file-abc", 1).await.unwrap().as_deref(),
            Some(&b"second"[..])
        );
        assert_eq!(dir.get("file-abc", 2).await.unwrap(), None);
        assert_eq!(dir.get("file-none", 0).await.unwrap(), None);
        dir.remove("file-abc").await.unwrap();
        assert_eq!(dir.get("file-abc", 0).await.unwrap(), None);
        dir.remove("file-abc").await.unwrap();
        for bad in ["../x", "a/b", "", ".."] {
            assert!(dir.put(bad, 0, b"x").await.is_err(), "{bad}");
            assert!(dir.get(bad, 0).await.is_err(), "{bad}");
        }
        assert!(!tmp.join("x").exists());
        let _ = std::fs::remove_dir_all(&tmp);
    }
}
