//! The backend kinds, defined once. Every list of kinds on every side derives from
//! [`BackendKind::ALL`] or is checked against it by a test: the API's two `oneof backend`
//! (this file's tests read the descriptor), the notation, the registry's record tag, the
//! dataplane's dispatch, the StorageClass parameter, the node report, the chart's schema and
//! the docs' tables. A new kind starts as a field of `VolumeSpec.backend`; the compiler then
//! stops at [`BackendKind::of`], and the test here until `ALL` lists it.

use crate::v1::get_capacity_request::Backend as CapacityBackend;
use crate::v1::volume_spec::Backend;

/// A kind of backend: where a volume's blocks live (null, the kind of no backend, by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum BackendKind {
    /// Nothing: reads are zeroes, writes are dropped (benchmarks, tests).
    #[default]
    Null,
    /// A tmpfs file in ublkd's RAM directory.
    Ram,
    /// A backing file under one of ublkd's allowed roots.
    File,
    /// A window of an NVMe namespace, driven by passthrough commands.
    Nvme,
}

impl BackendKind {
    /// Every kind, in the API's field order.
    pub const ALL: [BackendKind; 4] = [
        BackendKind::Null,
        BackendKind::Ram,
        BackendKind::File,
        BackendKind::Nvme,
    ];

    /// Its name: the `oneof` field, the notation's word, the record's tag, the StorageClass's
    /// `backend`, the metrics' `backend` label.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Null => "null",
            BackendKind::Ram => "ram",
            BackendKind::File => "file",
            BackendKind::Nvme => "nvme",
        }
    }

    /// The kind named `name` (exactly as [`name`](Self::name) writes it).
    pub fn named(name: &str) -> Option<BackendKind> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Whether the kind has a pool with a capacity (GetCapacity, a StorageClass, a
    /// CSIStorageCapacity): every kind but null.
    pub fn has_pool(self) -> bool {
        match self {
            BackendKind::Null => false,
            BackendKind::Ram | BackendKind::File | BackendKind::Nvme => true,
        }
    }

    /// The kinds with a pool, as a person is told them ("ram, file or nvme").
    pub fn pool_names() -> String {
        let names: Vec<&str> = Self::ALL
            .into_iter()
            .filter(|k| k.has_pool())
            .map(BackendKind::name)
            .collect();
        or_list(&names)
    }

    /// Every kind, as a person is told them ("null, ram, file or nvme").
    pub fn all_names() -> String {
        let names: Vec<&str> = Self::ALL.into_iter().map(BackendKind::name).collect();
        or_list(&names)
    }

    /// The kind of a volume's backend.
    pub fn of(backend: &Backend) -> BackendKind {
        match backend {
            Backend::Null(_) => BackendKind::Null,
            Backend::Ram(_) => BackendKind::Ram,
            Backend::File(_) => BackendKind::File,
            Backend::Nvme(_) => BackendKind::Nvme,
        }
    }

    /// The kind a capacity question names.
    pub fn of_capacity(backend: &CapacityBackend) -> BackendKind {
        match backend {
            CapacityBackend::Ram(_) => BackendKind::Ram,
            CapacityBackend::File(_) => BackendKind::File,
            CapacityBackend::Nvme(_) => BackendKind::Nvme,
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// "a, b or c".
fn or_list(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [one] => (*one).to_owned(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;
    use prost_types::FileDescriptorSet;

    /// The field names of `oneof backend` in `message`, in field-number order.
    fn oneof_fields(message: &str) -> Vec<String> {
        let set = FileDescriptorSet::decode(crate::FILE_DESCRIPTOR_SET).expect("descriptor");
        let msg = set
            .file
            .iter()
            .flat_map(|f| &f.message_type)
            .find(|m| m.name() == message)
            .unwrap_or_else(|| panic!("no message {message}"));
        let index = msg
            .oneof_decl
            .iter()
            .position(|o| o.name() == "backend")
            .expect("a oneof backend") as i32;
        let mut fields: Vec<_> = msg
            .field
            .iter()
            .filter(|f| f.oneof_index == Some(index))
            .collect();
        fields.sort_by_key(|f| f.number());
        fields.iter().map(|f| f.name().to_owned()).collect()
    }

    #[test]
    fn all_lists_the_apis_oneof_in_order_and_the_pools_are_the_capacity_oneof() {
        let all: Vec<&str> = BackendKind::ALL.iter().map(|k| k.name()).collect();
        assert_eq!(oneof_fields("VolumeSpec"), all);
        let mut pools: Vec<String> = oneof_fields("GetCapacityRequest");
        pools.sort();
        let mut want: Vec<&str> = BackendKind::ALL
            .iter()
            .filter(|k| k.has_pool())
            .map(|k| k.name())
            .collect();
        want.sort_unstable();
        assert_eq!(pools, want);
    }

    #[test]
    fn names_read_back_and_lists_read_as_a_person_writes_them() {
        for k in BackendKind::ALL {
            assert_eq!(BackendKind::named(k.name()), Some(k));
            assert_eq!(k.to_string(), k.name());
        }
        assert_eq!(BackendKind::named("NVMe"), None);
        assert_eq!(BackendKind::all_names(), "null, ram, file or nvme");
        assert_eq!(BackendKind::pool_names(), "ram, file or nvme");
    }
}
