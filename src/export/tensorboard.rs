//! TensorBoard event files (`events.out.tfevents.*`): TFRecord framing around `Event` protobuf
//! messages, as TensorFlow's `tf.summary` and PyTorch's `SummaryWriter` write them.
//!
//! No maintained Rust crate writes them (tensorboard-rs is archived and built on the
//! unmaintained protobuf 2), so the messages are the few fields of TensorBoard's `event.proto`,
//! `summary.proto` and `tensor.proto` that a scalar and a text summary need, derived with
//! `prost` (no protoc), and the framing's checksum is `crc32c`'s.
//!
//! A record: the data's length (u64, little-endian), the masked CRC32C of those 8 bytes, the
//! data, the masked CRC32C of the data.

use prost::Message;

/// `tensorflow.Event`: one record of the file.
#[derive(Clone, PartialEq, Message)]
pub struct Event {
    /// Seconds since the Unix epoch.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// The global step (or epoch) the summary belongs to.
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// The file version (first record) or a summary.
    #[prost(oneof = "What", tags = "3, 5")]
    pub what: Option<What>,
}

/// `Event.what`.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    /// `brain.Event:2`, the first record of every file.
    #[prost(string, tag = "3")]
    FileVersion(String),
    /// Values.
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, Message)]
pub struct Summary {
    /// Tagged values.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value`.
#[derive(Clone, PartialEq, Message)]
pub struct SummaryValue {
    /// The series, e.g. `train/loss`.
    #[prost(string, tag = "1")]
    pub tag: String,
    /// Which plugin shows it (text); none for a simple scalar.
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
    /// The value.
    #[prost(oneof = "Value", tags = "2, 8")]
    pub value: Option<Value>,
}

/// `Summary.Value.value`.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Value {
    /// A scalar (the scalars dashboard).
    #[prost(float, tag = "2")]
    SimpleValue(f32),
    /// A tensor (here a string, for the text dashboard).
    #[prost(message, tag = "8")]
    Tensor(TensorProto),
}

/// `tensorflow.SummaryMetadata`.
#[derive(Clone, PartialEq, Message)]
pub struct SummaryMetadata {
    /// The plugin.
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
}

/// `SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, Message)]
pub struct PluginData {
    /// `text` for a text summary.
    #[prost(string, tag = "1")]
    pub plugin_name: String,
}

/// `tensorflow.TensorProto`, a string scalar only.
#[derive(Clone, PartialEq, Message)]
pub struct TensorProto {
    /// `DT_STRING` (7).
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    /// A scalar: no dimensions.
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShape>,
    /// The string.
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

/// `tensorflow.TensorShapeProto` (no dimensions: a scalar).
#[derive(Clone, PartialEq, Message)]
pub struct TensorShape {}

/// TensorFlow's `DT_STRING`.
const DT_STRING: i32 = 7;

/// The CRC of TFRecord framing: CRC32C, rotated and offset (so a CRC of data holding CRCs is
/// not degenerate).
fn masked_crc(bytes: &[u8]) -> u32 {
    let c = crc32c::crc32c(bytes);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// `event` framed as one TFRecord record.
pub fn record(event: &Event) -> Vec<u8> {
    let data = event.encode_to_vec();
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(&data);
    out.extend_from_slice(&masked_crc(&data).to_le_bytes());
    out
}

/// The events of a file's bytes, in order, up to the first record that is torn (a kill while
/// writing) or fails its checksum; with the byte length of the good prefix.
pub fn read_records(bytes: &[u8]) -> (Vec<Event>, usize) {
    let mut events = Vec::new();
    let mut at = 0;
    while let Some(head) = bytes.get(at..at + 12) {
        let (len, crc) = head.split_at(8);
        let n = u64::from_le_bytes(len.try_into().unwrap_or_default());
        if masked_crc(len) != u32::from_le_bytes(crc.try_into().unwrap_or_default()) {
            break;
        }
        let end = usize::try_from(n)
            .ok()
            .and_then(|n| (at + 12).checked_add(n));
        let Some(data) = end.and_then(|e| bytes.get(at + 12..e)) else {
            break;
        };
        let Some(crc) = end.and_then(|e| bytes.get(e..e + 4)) else {
            break;
        };
        if masked_crc(data) != u32::from_le_bytes(crc.try_into().unwrap_or_default()) {
            break;
        }
        let Ok(event) = Event::decode(data) else {
            break;
        };
        events.push(event);
        at += 16 + data.len();
    }
    (events, at)
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The first record of a file.
pub fn file_version() -> Event {
    Event {
        wall_time: now(),
        step: 0,
        what: Some(What::FileVersion("brain.Event:2".into())),
    }
}

/// Scalars `(tag, value)` at `step`, in one event.
pub fn scalars(step: i64, values: &[(&str, f64)]) -> Event {
    let value = values
        .iter()
        .map(|(tag, v)| SummaryValue {
            tag: tag.to_string(),
            metadata: None,
            value: Some(Value::SimpleValue(*v as f32)),
        })
        .collect();
    Event {
        wall_time: now(),
        step,
        what: Some(What::Summary(Summary { value })),
    }
}

/// A text summary (markdown, shown by the text dashboard) at `step`.
pub fn text(step: i64, tag: &str, markdown: &str) -> Event {
    let tensor = TensorProto {
        dtype: DT_STRING,
        tensor_shape: Some(TensorShape {}),
        string_val: vec![markdown.as_bytes().to_vec()],
    };
    let value = SummaryValue {
        tag: tag.to_string(),
        metadata: Some(SummaryMetadata {
            plugin_data: Some(PluginData {
                plugin_name: "text".into(),
            }),
        }),
        value: Some(Value::Tensor(tensor)),
    };
    Event {
        wall_time: now(),
        step,
        what: Some(What::Summary(Summary { value: vec![value] })),
    }
}
