//! Metrics: define (same name and type: same id), increment (negative on a counter: `BadArgument`),
//! record, get (histograms: `BadArgument`), process-wide like Envoy stats.

use super::memory::{HostResult, guest_write, ok, read_or_status, refuse_if_asked, status};
use super::{ENV, VmState, lock};
use crate::abi::{MetricType, Status};
use wasmtime::{Caller, Linker};

/// A metric as the proxy holds it (process-wide, like Envoy stats).
#[derive(Clone, Debug, PartialEq)]
pub struct Metric {
    pub name: String,
    pub kind: MetricType,
    /// Counter total or gauge value.
    pub value: i64,
    /// Histogram samples.
    pub samples: Vec<u64>,
}

/// Links the metric calls.
pub(super) fn add_metrics(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    // Kept whole: one registration per metric host function, a flat list.
    linker.func_wrap(
        ENV,
        "proxy_define_metric",
        |mut c: Caller<'_, VmState>, kind: i32, nptr: i32, nlen: i32, id_ptr: i32| -> HostResult {
            refuse_if_asked!(c, "proxy_define_metric");
            let name = String::from_utf8_lossy(&read_or_status!(&mut c, nptr, nlen)).into_owned();
            let Some(kind) = MetricType::from_raw(kind) else {
                return status(Status::BadArgument);
            };
            let id = {
                let mut metrics = lock(&c.data().shared().metrics);
                match metrics.iter().position(|m| m.name == name) {
                    Some(i) if metrics[i].kind == kind => i,
                    Some(_) => return status(Status::BadArgument),
                    None => {
                        metrics.push(Metric {
                            name,
                            kind,
                            value: 0,
                            samples: Vec::new(),
                        });
                        metrics.len() - 1
                    }
                }
            };
            match guest_write(&mut c, id_ptr as u32, &(id as u32 + 1).to_le_bytes()) {
                Ok(()) => ok(),
                Err(s) => status(s),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_metric",
        |mut c: Caller<'_, VmState>, id: i32, out: i32| -> HostResult {
            let value = {
                let metrics = lock(&c.data().shared().metrics);
                match metrics.get((id as u32 as usize).wrapping_sub(1)) {
                    None => return status(Status::NotFound),
                    Some(m) if m.kind == MetricType::Histogram => {
                        return status(Status::BadArgument);
                    }
                    Some(m) => m.value as u64,
                }
            };
            match guest_write(&mut c, out as u32, &value.to_le_bytes()) {
                Ok(()) => ok(),
                Err(s) => status(s),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_record_metric",
        |c: Caller<'_, VmState>, id: i32, value: i64| -> HostResult {
            refuse_if_asked!(c, "proxy_record_metric");
            let mut metrics = lock(&c.data().shared().metrics);
            match metrics.get_mut((id as u32 as usize).wrapping_sub(1)) {
                None => status(Status::NotFound),
                Some(m) => {
                    match m.kind {
                        MetricType::Counter => m.value = m.value.wrapping_add(value),
                        MetricType::Gauge => m.value = value,
                        MetricType::Histogram => {
                            if m.samples.len() < 1_000_000 {
                                m.samples.push(value as u64)
                            }
                        }
                    }
                    ok()
                }
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_increment_metric",
        |c: Caller<'_, VmState>, id: i32, offset: i64| -> HostResult {
            refuse_if_asked!(c, "proxy_increment_metric");
            let mut metrics = lock(&c.data().shared().metrics);
            match metrics.get_mut((id as u32 as usize).wrapping_sub(1)) {
                None => status(Status::NotFound),
                Some(m) => match m.kind {
                    MetricType::Counter if offset < 0 => status(Status::BadArgument),
                    MetricType::Counter | MetricType::Gauge => {
                        m.value = m.value.wrapping_add(offset);
                        ok()
                    }
                    MetricType::Histogram => status(Status::BadArgument),
                },
            }
        },
    )?;
    Ok(())
}
