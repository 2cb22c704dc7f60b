//! Kind `azure`: Azure OpenAI. A target's `model` names the deployment:
//! `POST {base_url}/openai/deployments/{deployment}/chat/completions?api-version=V`
//! (and `.../embeddings`), with the key in an `api-key` header. Requests and
//! replies are OpenAI's wire format, as they are. It speaks chat
//! completions and embeddings.

use bytes::Bytes;
use reqwest::header::{HeaderName, HeaderValue};
use secrecy::{ExposeSecret, SecretString};

use super::openai::secret_header;
use super::{Api, Outgoing};
use crate::config::{AZURE_API_VERSION, ProviderConfig, chat_url};
use crate::dialect::{Dialect, Forwarded};

/// The Azure OpenAI dialect of one resource.
#[derive(Debug)]
pub struct Azure {
    /// `{base_url}/openai/deployments/`.
    deployments: reqwest::Url,
    api_version: String,
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl Azure {
    pub fn new(config: &ProviderConfig, key: Option<SecretString>) -> Result<Azure, String> {
        chat_url(&config.base_url)?;
        let base = config.base_url.trim_end_matches('/');
        let deployments = reqwest::Url::parse(&format!("{base}/openai/deployments/"))
            .map_err(|e| format!("{base:?} is not a URL: {e}"))?;
        let headers = key
            .map(|k| secret_header(HeaderName::from_static("api-key"), k.expose_secret()))
            .transpose()?
            .into_iter()
            .collect();
        Ok(Azure {
            deployments,
            api_version: config
                .api_version
                .clone()
                .unwrap_or_else(|| AZURE_API_VERSION.to_string()),
            headers,
        })
    }

    /// The URL of `deployment`'s API for `dialect`.
    pub fn url(&self, deployment: &str, dialect: Dialect) -> Result<reqwest::Url, String> {
        let path = match dialect {
            Dialect::Chat => "chat/completions",
            Dialect::Embeddings => "embeddings",
            other => return Err(format!("Azure OpenAI does not speak {}", other.as_str())),
        };
        let mut url = self.deployments.clone();
        url.path_segments_mut()
            .map_err(|()| "the base_url cannot carry a path".to_string())?
            .pop_if_empty()
            .push(deployment)
            .extend(path.split('/'));
        url.query_pairs_mut()
            .append_pair("api-version", &self.api_version);
        Ok(url)
    }
}

impl Api for Azure {
    fn speaks(&self, dialect: Dialect) -> bool {
        matches!(dialect, Dialect::Chat | Dialect::Embeddings)
    }

    /// The deployment is the target's model.
    fn request(
        &self,
        dialect: Dialect,
        model: &str,
        body: Bytes,
        forwarded: &Forwarded,
    ) -> Result<Outgoing, String> {
        Ok(Outgoing {
            url: self.url(model, dialect)?,
            headers: super::with_forwarded(&self.headers, forwarded),
            body,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn azure(base: &str) -> Azure {
        let config: ProviderConfig = toml::from_str(&format!(
            "name = \"az\"\nkind = \"azure\"\nbase_url = \"{base}\"\n"
        ))
        .unwrap();
        Azure::new(&config, Some(SecretString::from("k"))).unwrap()
    }

    #[test]
    fn the_deployment_url_carries_the_api_version() {
        for base in [
            "https://res.openai.azure.com",
            "https://res.openai.azure.com/",
        ] {
            let url = azure(base).url("gpt4o-prod", Dialect::Chat).unwrap();
            assert_eq!(
                url.as_str(),
                "https://res.openai.azure.com/openai/deployments/gpt4o-prod/chat/completions?api-version=2024-10-21"
            );
        }
        let url = azure("http://127.0.0.1:9/prefix")
            .url("emb 1", Dialect::Embeddings)
            .unwrap();
        assert_eq!(
            url.as_str(),
            "http://127.0.0.1:9/prefix/openai/deployments/emb%201/embeddings?api-version=2024-10-21"
        );
    }

    #[test]
    fn the_key_goes_in_an_api_key_header() {
        let a = azure("https://res.openai.azure.com");
        let out = a
            .request(
                Dialect::Chat,
                "d",
                Bytes::from_static(br#"{"model":"d"}"#),
                &Forwarded::default(),
            )
            .unwrap();
        assert_eq!(out.headers.len(), 1);
        assert_eq!(out.headers[0].0, "api-key");
        assert_eq!(out.headers[0].1, "k");
        assert!(
            out.url
                .path()
                .ends_with("/openai/deployments/d/chat/completions")
        );
    }
}
