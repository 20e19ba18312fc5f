//! `prism up --head-auth`: the embedded head asks for tokens. One random token per role is
//! generated in-process (admin, worker, router); the worker and router present theirs, and
//! the admin token is written, readable only by this user, to a file whose path `prism up`
//! prints (`prism status --token-file PATH`). Nothing is persisted: every start makes new
//! tokens, and the file is removed on exit.

use anyhow::{Context, Result};
use prism_common::head_auth::HeadCredential;
use prism_head::auth::HeadAuth;
use rand::Rng;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The generated tokens and the admin token's file.
pub struct UpHeadAuth {
    admin: String,
    worker: String,
    router: String,
    admin_file: PathBuf,
    /// Holds `admin_file` (mode 0700; removed on drop).
    _dir: tempfile::TempDir,
}

/// 32 random hex characters (128 bits) from the OS-seeded generator.
fn random_token() -> String {
    let bytes: [u8; 16] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl UpHeadAuth {
    /// Generates the tokens and writes the admin token (mode 0600).
    ///
    /// # Errors
    /// The temporary directory or file cannot be written.
    pub fn generate() -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("prism-up-auth-").tempdir()?;
        let admin_file = dir.path().join("admin-token");
        let admin = random_token();
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut f = options.open(&admin_file).with_context(|| format!("cannot write {}", admin_file.display()))?;
        writeln!(f, "{admin}")?;
        Ok(Self { admin, worker: random_token(), router: random_token(), admin_file, _dir: dir })
    }

    /// The head's accepted tokens.
    ///
    /// # Errors
    /// Never in practice (the generated file is well formed).
    pub fn head_auth(&self) -> Result<HeadAuth> {
        let text = format!(
            "{} role=admin name=prism-up-admin\n{} role=worker name=prism-up-worker\n{} role=router name=prism-up-router\n",
            self.admin, self.worker, self.router
        );
        Ok(HeadAuth::parse(&text, "prism up --head-auth")?)
    }

    /// What `prism up`'s own admin calls present.
    pub fn admin(&self) -> HeadCredential {
        HeadCredential::Token(self.admin.clone())
    }

    /// What the embedded worker presents.
    pub fn worker(&self) -> HeadCredential {
        HeadCredential::Token(self.worker.clone())
    }

    /// What the embedded router presents.
    pub fn router(&self) -> HeadCredential {
        HeadCredential::Token(self.router.clone())
    }

    /// The admin token's file.
    pub fn admin_file(&self) -> &Path {
        &self.admin_file
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prism_head::auth::{Role, Rpc};

    #[test]
    fn each_component_gets_its_own_role() {
        let a = UpHeadAuth::generate().expect("generates");
        let auth = a.head_auth().expect("parses");
        let who = |c: HeadCredential, rpc| {
            let HeadCredential::Token(t) = c else { panic!("a token") };
            auth.authorize(Some(format!("Bearer {t}").as_bytes()), rpc).map(|c| c.role)
        };
        assert_eq!(who(a.admin(), Rpc::DrainNode).ok(), Some(Some(Role::Admin)));
        assert_eq!(who(a.worker(), Rpc::WorkerSession).ok(), Some(Some(Role::Worker)));
        assert!(who(a.worker(), Rpc::DrainNode).is_err());
        assert_eq!(who(a.router(), Rpc::WatchRoutes).ok(), Some(Some(Role::Router)));
        let on_disk = std::fs::read_to_string(a.admin_file()).expect("written");
        assert_eq!(
            Some(on_disk.trim().to_owned()),
            match a.admin() {
                HeadCredential::Token(t) => Some(t),
                _ => None,
            }
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(a.admin_file()).expect("stat").permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert_ne!(random_token(), random_token());
    }
}
