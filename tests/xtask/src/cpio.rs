//! A minimal writer for the `newc` cpio format the kernel unpacks as an initramfs.

use std::io::{self, Write};

#[derive(Debug, Default)]
pub struct Archive {
    buf: Vec<u8>,
    ino: u32,
}

impl Archive {
    pub fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, &[]);
    }

    pub fn file(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.entry(name, 0o100_000 | mode, data);
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.ino += 1;
        let name = name.trim_start_matches('/');
        let (size, name_size) = (data.len() as u32, name.len() as u32 + 1);
        // ino, mode, uid, gid, nlink, mtime, filesize, dev and rdev (major, minor), namesize,
        // check.
        let fields = [self.ino, mode, 0, 0, 1, 0, size, 0, 0, 0, 0, name_size, 0];
        self.buf.extend_from_slice(b"070701");
        for f in fields {
            self.buf.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad();
        self.buf.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        self.buf.resize(self.buf.len().next_multiple_of(4), 0);
    }

    /// Appends the trailer and writes the archive.
    pub fn finish(mut self, out: &mut impl Write) -> io::Result<()> {
        self.ino = 0;
        self.entry("TRAILER!!!", 0, &[]);
        out.write_all(&self.buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_four_byte_aligned_and_end_with_trailer() {
        let mut a = Archive::default();
        a.dir("bin");
        a.file("bin/x", 0o755, b"hello");
        let mut out = Vec::new();
        a.finish(&mut out).unwrap();
        assert_eq!(out.len() % 4, 0);
        assert!(out.starts_with(b"070701"));
        let text = String::from_utf8_lossy(&out);
        assert!(text.contains("bin/x\0"));
        assert!(text.contains("hello"));
        assert!(text.contains("TRAILER!!!\0"));
        // The file entry records its size (5) in the seventh field.
        let x = text.find("bin/x").unwrap();
        let header = &text[x - 110..x];
        assert_eq!(&header[6 + 6 * 8..6 + 7 * 8], "00000005");
    }
}
