//! `runtime.v1.ImageService`.

use std::sync::Arc;

use hako_proto::cri;
use hako_proto::cri::image_service_server::ImageService;
use tonic::{Request, Response, Status};

use super::{now_nanos, status};
use crate::daemon::Daemon;
use crate::error::Error;
use crate::image::{Credentials, ImageInfo};

pub struct ImageSvc {
    pub(super) daemon: Arc<Daemon>,
}

fn to_cri(i: ImageInfo) -> cri::Image {
    cri::Image {
        spec: Some(cri::ImageSpec {
            image: i.id.clone(),
            ..Default::default()
        }),
        id: i.id,
        repo_tags: i.repo_tags,
        repo_digests: i.repo_digests,
        size: i.size,
        uid: i.uid.map(|value| cri::Int64Value { value }),
        username: i.username,
        pinned: false,
    }
}

/// The image reference of a spec, rejecting runtime handlers hako does not have (the
/// configured ones share the default's images).
fn image_ref<'a>(spec: Option<&'a cri::ImageSpec>, daemon: &Daemon) -> Result<&'a str, Error> {
    let spec = spec.ok_or_else(|| Error::InvalidArgument("image spec is missing".into()))?;
    super::runtime::check_handler(daemon, &spec.runtime_handler)?;
    if spec.image.trim().is_empty() {
        return Err(Error::InvalidArgument("image reference is empty".into()));
    }
    Ok(&spec.image)
}

#[tonic::async_trait]
impl ImageService for ImageSvc {
    async fn list_images(
        &self,
        req: Request<cri::ListImagesRequest>,
    ) -> Result<Response<cri::ListImagesResponse>, Status> {
        let req = req.into_inner();
        let filter = req
            .filter
            .as_ref()
            .and_then(|f| f.image.as_ref())
            .map(|s| s.image.as_str());
        tracing::debug!(rpc = "ListImages", ?filter);
        let images = self
            .daemon
            .images
            .list(filter)
            .map_err(|e| status("ListImages", e))?;
        Ok(Response::new(cri::ListImagesResponse {
            images: images.into_iter().map(to_cri).collect(),
        }))
    }

    type StreamImagesStream = super::runtime::ListStream<cri::StreamImagesResponse>;

    async fn stream_images(
        &self,
        req: Request<cri::StreamImagesRequest>,
    ) -> Result<Response<Self::StreamImagesStream>, Status> {
        let filter = req.into_inner().filter;
        let images = self
            .list_images(Request::new(cri::ListImagesRequest { filter }))
            .await?
            .into_inner()
            .images;
        Ok(super::runtime::chunked(images, |images| {
            cri::StreamImagesResponse { images }
        }))
    }

    async fn image_status(
        &self,
        req: Request<cri::ImageStatusRequest>,
    ) -> Result<Response<cri::ImageStatusResponse>, Status> {
        let req = req.into_inner();
        let r =
            image_ref(req.image.as_ref(), &self.daemon).map_err(|e| status("ImageStatus", e))?;
        tracing::debug!(rpc = "ImageStatus", image = r);
        // An unknown image is not an error: the response just has no image (kubelet relies on it).
        let found = self
            .daemon
            .images
            .status(r, req.verbose)
            .map_err(|e| status("ImageStatus", e))?;
        let mut resp = cri::ImageStatusResponse::default();
        if let Some((info, verbose)) = found {
            resp.image = Some(to_cri(info));
            if let Some(v) = verbose {
                resp.info.insert("info".into(), v);
            }
        }
        Ok(Response::new(resp))
    }

    async fn pull_image(
        &self,
        req: Request<cri::PullImageRequest>,
    ) -> Result<Response<cri::PullImageResponse>, Status> {
        let req = req.into_inner();
        let r = image_ref(req.image.as_ref(), &self.daemon).map_err(|e| status("PullImage", e))?;
        tracing::debug!(rpc = "PullImage", image = r);
        let creds = req
            .auth
            .map(|a| Credentials {
                username: a.username,
                password: a.password,
                auth: a.auth,
                server_address: a.server_address,
                identity_token: a.identity_token,
                registry_token: a.registry_token,
            })
            .unwrap_or_default();
        let id = self
            .daemon
            .images
            .pull(r, &creds)
            .await
            .map_err(|e| status("PullImage", e))?;
        Ok(Response::new(cri::PullImageResponse { image_ref: id }))
    }

    async fn remove_image(
        &self,
        req: Request<cri::RemoveImageRequest>,
    ) -> Result<Response<cri::RemoveImageResponse>, Status> {
        let req = req.into_inner();
        let r =
            image_ref(req.image.as_ref(), &self.daemon).map_err(|e| status("RemoveImage", e))?;
        tracing::debug!(rpc = "RemoveImage", image = r);
        self.daemon
            .images
            .remove(r)
            .await
            .map_err(|e| status("RemoveImage", e))?;
        Ok(Response::new(cri::RemoveImageResponse {}))
    }

    async fn image_fs_info(
        &self,
        _req: Request<cri::ImageFsInfoRequest>,
    ) -> Result<Response<cri::ImageFsInfoResponse>, Status> {
        tracing::debug!(rpc = "ImageFsInfo");
        let u = self
            .daemon
            .images
            .fs_usage()
            .map_err(|e| status("ImageFsInfo", e))?;
        let usage = cri::FilesystemUsage {
            timestamp: now_nanos(),
            fs_id: Some(cri::FilesystemIdentifier {
                mountpoint: u.mountpoint.to_string_lossy().into_owned(),
            }),
            used_bytes: Some(cri::UInt64Value {
                value: u.used_bytes,
            }),
            inodes_used: Some(cri::UInt64Value {
                value: u.inodes_used,
            }),
        };
        Ok(Response::new(cri::ImageFsInfoResponse {
            image_filesystems: vec![usage],
            container_filesystems: vec![],
        }))
    }
}
