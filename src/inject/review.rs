//! The AdmissionReview exchange: read the API server's request, decide,
//! and answer in the form the API server reads.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use k8s_openapi::api::core::v1::Pod;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use serde_json::Value;

use super::decision::{Decision, Skip, decide};
use super::settings::SidecarDefaults;

/// Answers one AdmissionReview (the request body as it came) with the
/// AdmissionReview to send back, as JSON, logging the decision.
pub fn review(body: &[u8], defaults: &SidecarDefaults) -> Value {
    to_wire(answer(body, defaults))
}

/// The API server reads `response.patch` as Go reads a `[]byte`: a base64
/// string. kube-core writes the bytes as an array of numbers, so the patch
/// is re-encoded here.
fn to_wire(review: AdmissionReview<DynamicObject>) -> Value {
    let patch = review.response.as_ref().and_then(|r| r.patch.clone());
    let mut wire = serde_json::to_value(&review).expect("an AdmissionReview serializes");
    if let (Some(bytes), Some(response)) = (patch, wire.get_mut("response")) {
        response["patch"] = Value::String(BASE64.encode(bytes));
    }
    wire
}

fn answer(body: &[u8], defaults: &SidecarDefaults) -> AdmissionReview<DynamicObject> {
    let review: AdmissionReview<Pod> = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "an AdmissionReview that cannot be read");
            return AdmissionResponse::invalid(format!(
                "courier: cannot read the AdmissionReview: {e}"
            ))
            .into_review();
        }
    };
    let request: AdmissionRequest<Pod> = match review.try_into() {
        Ok(r) => r,
        Err(_) => {
            tracing::warn!("an AdmissionReview without a request");
            return AdmissionResponse::invalid("courier: the AdmissionReview has no request")
                .into_review();
        }
    };
    let decision = match (&request.operation, &request.object) {
        (Operation::Create, Some(pod)) => decide(pod, defaults),
        _ => Decision::Skip(Skip::NotACreate),
    };
    let pod_name = request
        .object
        .as_ref()
        .and_then(|p| {
            p.metadata
                .name
                .clone()
                .or_else(|| p.metadata.generate_name.as_ref().map(|g| format!("{g}*")))
        })
        .unwrap_or_else(|| request.name.clone());
    let namespace = request.namespace.clone().unwrap_or_default();
    let reason = decision.reason();
    let message = decision.message();
    match &decision {
        Decision::Deny(_) => tracing::warn!(
            uid = %request.uid, %namespace, pod = %pod_name, reason, %message,
            "admission decision"
        ),
        _ => tracing::info!(
            uid = %request.uid, %namespace, pod = %pod_name, reason, %message,
            "admission decision"
        ),
    }

    let mut response = AdmissionResponse::from(&request);
    response
        .audit_annotations
        .insert("decision".into(), reason.into());
    match decision {
        Decision::Inject {
            patch, warnings, ..
        } => {
            if !warnings.is_empty() {
                response.warnings = Some(warnings);
            }
            response.result.message = message;
            match response.with_patch(patch) {
                Ok(r) => r.into_review(),
                Err(e) => AdmissionResponse::from(&request)
                    .deny(format!("courier: cannot encode the patch: {e}"))
                    .into_review(),
            }
        }
        Decision::Skip(skip) => {
            if skip == Skip::HostNetwork {
                response.warnings = Some(vec![message.clone()]);
            }
            response.result.message = message;
            response.into_review()
        }
        Decision::Deny(_) => {
            let mut response = response.deny(&message);
            response.result.reason = "Invalid".into();
            response.result.code = 400;
            response.into_review()
        }
    }
}
