//! The API's answers as JSON: each message serialised through the API's own descriptor
//! (proto3's JSON mapping with the proto field names, enum values by name, 64-bit integers as
//! numbers, and every field the message has), so that `-o json` and `-o yaml` say exactly what
//! ublkd answered: a field the API gains is printed without a line written here.

use crate::error::Error;
use prost::Message;
use prost_reflect::{DescriptorPool, DynamicMessage, SerializeOptions};
use std::sync::OnceLock;

/// The API's descriptors, read once from the built-in set.
fn pool() -> Result<&'static DescriptorPool, Error> {
    static POOL: OnceLock<Result<DescriptorPool, String>> = OnceLock::new();
    POOL.get_or_init(|| {
        DescriptorPool::decode(ublkd_proto::FILE_DESCRIPTOR_SET).map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| Error::Encode(format!("reading the API's descriptors: {e}")))
}

/// `msg`, a `ublkd.v1.<name>`, as a JSON value.
pub fn value<M: Message>(msg: &M, name: &str) -> Result<serde_json::Value, Error> {
    let full = format!("{}.{name}", ublkd_proto::API_PACKAGE);
    let descriptor = pool()?
        .get_message_by_name(&full)
        .ok_or_else(|| Error::Encode(format!("no message {full} in the API")))?;
    let dynamic = DynamicMessage::decode(descriptor, msg.encode_to_vec().as_slice())
        .map_err(|e| Error::Encode(format!("{full}: {e}")))?;
    let options = SerializeOptions::new()
        .stringify_64_bit_integers(false)
        .use_proto_field_name(true)
        .skip_default_fields(false);
    dynamic
        .serialize_with_options(serde_json::value::Serializer, &options)
        .map_err(|e| Error::Encode(format!("{full}: {e}")))
}

/// `msg`, a `ublkd.v1.<name>`, as indented JSON.
pub fn pretty<M: Message>(msg: &M, name: &str) -> Result<String, Error> {
    let v = value(msg, name)?;
    serde_json::to_string_pretty(&v).map_err(|e| Error::Encode(format!("ublkd.v1.{name}: {e}")))
}
