//! gRPC over TLS: a CA and a server certificate made at test time, the binary serving with them,
//! a client trusting that CA making authenticated calls, and the clients that must fail (plain
//! text, another CA). Start-up refuses half a TLS configuration, naming the missing key, and TLS
//! does not lift the rule that a server without tokens listens on loopback only.

use std::path::Path;
use std::time::Duration;

use anima_gateway::api;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose};
use tonic::transport::{Certificate, Channel, ClientTlsConfig};
use tonic::Code;

use crate::fixture::*;

/// A CA and a certificate it signed for `localhost` and `127.0.0.1`, as PEM.
struct TestPki {
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
}

fn test_pki(name: &str) -> TestPki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(DnType::CommonName, format!("{name} test CA"));
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("CA key")).expect("CA certificate");
    let key = KeyPair::generate().expect("server key");
    let mut params =
        CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).expect("server params");
    params.distinguished_name.push(DnType::CommonName, "anima-wake");
    let cert = params.signed_by(&key, &*ca).expect("server certificate");
    TestPki { ca_pem: ca.pem(), cert_pem: cert.pem(), key_pem: key.serialize_pem() }
}

/// Writes the server's certificate and key under `dir`; returns the TOML keys naming them.
fn tls_config_keys(pki: &TestPki, dir: &Path) -> String {
    let cert = dir.join("server.crt");
    let key = dir.join("server.key");
    std::fs::write(&cert, &pki.cert_pem).expect("write certificate");
    std::fs::write(&key, &pki.key_pem).expect("write key");
    // TOML basic strings take the same escapes as Rust's Debug for these paths.
    format!("tls_cert = {:?}\ntls_key = {:?}\n", cert.display().to_string(), key.display().to_string())
}

/// Connects and calls `Wakes.Claim` for ada (nothing queued: no wake, but an authenticated,
/// authorized answer); any failure on the way is the error.
async fn claim_over(endpoint: tonic::transport::Endpoint) -> Result<api::ClaimResponse, String> {
    let channel = tokio::time::timeout(Duration::from_secs(10), endpoint.connect())
        .await
        .map_err(|_| "connect timed out".to_owned())?
        .map_err(|e| format!("connect: {e}"))?;
    let mut wakes = api::wakes_client::WakesClient::with_interceptor(channel, bearer(ADA_RUNTIME_TOKEN));
    let claim = api::ClaimRequest { agent_id: "ada".into(), worker_id: "tls-worker".into(), ..Default::default() };
    tokio::time::timeout(Duration::from_secs(10), wakes.claim(claim))
        .await
        .map_err(|_| "call timed out".to_owned())?
        .map(|r| r.into_inner())
        .map_err(|status| format!("{:?}: {}", status.code(), status.message()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_serves_authenticated_calls_to_clients_that_trust_its_ca() {
    let pki = test_pki("anima");
    let files = tempfile::tempdir().expect("temp dir");
    let server = Server::start_with(ServerOptions {
        config_prefix: tls_config_keys(&pki, files.path()),
        tls_ca_pem: Some(pki.ca_pem.clone()),
        ..ServerOptions::default()
    });

    // A client trusting the CA: authenticated calls work, and auth still applies.
    let mut sends = server.sends(ADA_RUNTIME_TOKEN).await;
    let response = sends.send(send_request("ada", slack_target("D1", ""))).await.expect("send over TLS").into_inner();
    assert!(matches!(response.verdict, Some(api::send_response::Verdict::Allowed(_))), "{response:?}");
    let mut wrong = server.sends("not-a-configured-token").await;
    let error = wrong.send(send_request("ada", slack_target("D1", ""))).await.unwrap_err();
    assert_eq!(error.code(), Code::Unauthenticated);
    let error = sends.send(send_request("bob", slack_target("D1", ""))).await.unwrap_err();
    assert_eq!(error.code(), Code::PermissionDenied);

    let trusted = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&pki.ca_pem)).domain_name("localhost");
    let endpoint = Channel::from_shared(format!("https://{}", server.addr)).unwrap().tls_config(trusted).unwrap();
    let claimed = claim_over(endpoint).await.expect("claim over TLS");
    assert!(claimed.wake.is_none(), "{claimed:?}");

    // Plain text against the TLS port fails.
    let plain = Channel::from_shared(format!("http://{}", server.addr)).unwrap();
    let error = claim_over(plain).await.expect_err("a plain-text client must not get an answer");
    assert!(!error.is_empty());

    // So does TLS with a CA that did not sign the server's certificate.
    let other = test_pki("other");
    let untrusted =
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&other.ca_pem)).domain_name("localhost");
    let endpoint = Channel::from_shared(format!("https://{}", server.addr)).unwrap().tls_config(untrusted).unwrap();
    claim_over(endpoint).await.expect_err("a client that does not trust the CA must not connect");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_tokens_may_listen_beyond_loopback() {
    let pki = test_pki("anima");
    let files = tempfile::tempdir().expect("temp dir");
    let server = Server::start_with(ServerOptions {
        config_prefix: tls_config_keys(&pki, files.path()),
        args: vec!["--listen".into(), "0.0.0.0:0".into()],
        tls_ca_pem: Some(pki.ca_pem.clone()),
        ..ServerOptions::default()
    });
    let mut sends = server.sends(ADA_RUNTIME_TOKEN).await;
    let response = sends.send(send_request("ada", slack_target("D1", ""))).await.expect("send over TLS").into_inner();
    assert!(response.verdict.is_some(), "{response:?}");
}

#[test]
fn half_a_tls_configuration_is_refused_naming_the_missing_key() {
    let pki = test_pki("anima");
    let files = tempfile::tempdir().expect("temp dir");
    let keys = tls_config_keys(&pki, files.path());
    let (cert_line, key_line) = keys.split_once('\n').expect("two lines");

    let stderr = serve_refused(&format!("{cert_line}\n{CONFIG}"), &["--listen", "127.0.0.1:0"]);
    assert!(stderr.contains("tls_key: missing"), "{stderr}");
    let stderr = serve_refused(&format!("{key_line}{CONFIG}"), &["--listen", "127.0.0.1:0"]);
    assert!(stderr.contains("tls_cert: missing"), "{stderr}");

    // The flags (and their environment twins) complete or override the file the same way.
    let stderr = serve_refused(CONFIG, &["--listen", "127.0.0.1:0", "--tls-cert", "/nonexistent/server.crt"]);
    assert!(stderr.contains("tls_key: missing"), "{stderr}");

    // Both set, but not a certificate: refused at start-up, not at the first handshake.
    let garbage = files.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate").unwrap();
    let garbage = garbage.display().to_string();
    let stderr = serve_refused(CONFIG, &["--listen", "127.0.0.1:0", "--tls-cert", &garbage, "--tls-key", &garbage]);
    assert!(stderr.contains("tls_cert, tls_key"), "{stderr}");
}

#[test]
fn without_tokens_tls_does_not_lift_the_loopback_rule() {
    let pki = test_pki("anima");
    let files = tempfile::tempdir().expect("temp dir");
    let keys = tls_config_keys(&pki, files.path());
    let stderr = serve_refused(&keys, &["--listen", "0.0.0.0:0"]);
    assert!(stderr.contains("listen: 0.0.0.0:0 is not a loopback address and no tokens are configured"), "{stderr}");
}
