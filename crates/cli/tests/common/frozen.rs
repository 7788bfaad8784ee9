//! A filesystem whose writes can be held (`fsfreeze`): tests that need a request to stay
//! running at a backend (io.rs's fencing tests, iscsi.rs's task management). Needs root and
//! loop devices.

use super::{sparse_file, TempDir};

/// An ext4 filesystem on a loop device, unmounted on drop (also when a test fails).
pub struct LoopExt4 {
    dir: TempDir,
}

impl LoopExt4 {
    pub fn new() -> LoopExt4 {
        super::need_tool("fsfreeze", "util-linux");
        super::need_tool("mkfs.ext4", "e2fsprogs");
        let dir = TempDir::new("freeze");
        let img = dir.path("ext4.img");
        sparse_file(&img, 64 << 20);
        std::fs::create_dir(dir.path("mnt")).unwrap();
        let run = |c: &mut std::process::Command| {
            let out = c.output().expect("run");
            assert!(
                out.status.success(),
                "{c:?}: {} (this test needs root and loop devices)",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        };
        run(std::process::Command::new("mkfs.ext4").arg("-q").arg(&img));
        run(std::process::Command::new("mount")
            .args(["-o", "loop"])
            .arg(&img)
            .arg(dir.path("mnt")));
        LoopExt4 { dir }
    }

    pub fn mnt(&self) -> std::path::PathBuf {
        self.dir.path("mnt")
    }

    /// Freezes it (`fsfreeze`): every write to it blocks until the guard is dropped. Declare
    /// the guard after anything that may write there, so it thaws first (a process stuck on
    /// a frozen filesystem cannot even be killed).
    pub fn freeze(&self) -> Frozen {
        let mnt = self.mnt();
        let out = std::process::Command::new("fsfreeze")
            .arg("-f")
            .arg(&mnt)
            .output()
            .unwrap();
        assert!(out.status.success(), "fsfreeze -f: {out:?}");
        Frozen(mnt)
    }
}

impl Drop for LoopExt4 {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.mnt())
            .status();
    }
}

/// A frozen filesystem, thawed on drop.
pub struct Frozen(std::path::PathBuf);

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = std::process::Command::new("fsfreeze")
            .arg("-u")
            .arg(&self.0)
            .status();
    }
}
