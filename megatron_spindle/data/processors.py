"""The preprocessing Hugging Face models were trained with, for patch and audio front ends (numpy / torch / Pillow,
no transformers): settings read from a model folder's ``preprocessor_config.json``.

- ``ImageProcessor``: CLIPImageProcessor's steps - RGB (transparency composited onto white, as transformers 5
  does), resize (the shortest edge to ``size.shortest_edge`` keeping
  the aspect ratio, or to ``size.height x size.width``; Pillow, ``resample`` (bicubic for CLIP)), centre crop to
  ``crop_size`` (zero-padded when smaller), rescale (``rescale_factor``, 1/255), normalise (``image_mean`` /
  ``image_std``): ``[3, crop, crop]`` float32.
- ``LogMelExtractor``: WhisperFeatureExtractor's log-mel - the waveform zero-padded or cut to ``frames x
  hop_length`` samples, ``torch.stft`` (``n_fft``, Hann window, centred, reflect padding), power, a Slaney-normalised
  Slaney-scale mel filter bank over [0, 8 kHz], ``log10`` (floor 1e-10), the last frame dropped, values clamped to
  (max - 8), then ``(x + 4) / 4``: ``[feature_size, frames]``. The sample rate must be the extractor's
  (``sampling_rate``, 16 kHz for Whisper): it is checked, not converted.

tests/data compares both with the transformers classes on sample inputs.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

PREPROCESSOR_FILE = "preprocessor_config.json"


class ProcessorError(ValueError):
    """A preprocessor folder that cannot be read or does not fit the module it is given for."""


def read_preprocessor_config(path: str | Path) -> dict:
    path = Path(path)
    cfg = path / PREPROCESSOR_FILE if path.is_dir() else path
    if not cfg.is_file():
        raise ProcessorError(f"{path}: no {PREPROCESSOR_FILE} (the Hugging Face model folder's preprocessing "
                             f"settings)")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ProcessorError(f"{cfg}: not valid JSON: {e}") from None


def _hw(value, what: str) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    if isinstance(value, dict) and "height" in value and "width" in value:
        return int(value["height"]), int(value["width"])
    raise ProcessorError(f"{what} {value!r}: expected an integer or {{height, width}}")


@dataclass(frozen=True)
class ImageProcessor:
    shortest_edge: int | None = 224  # resize the shortest edge to this (aspect kept) ...
    resize_hw: tuple[int, int] | None = None  # ... or to exactly (height, width)
    do_resize: bool = True
    resample: int = 3  # Pillow's BICUBIC
    do_center_crop: bool = True
    crop_hw: tuple[int, int] = (224, 224)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    do_convert_rgb: bool = True

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ImageProcessor:
        cfg = read_preprocessor_config(path)
        kind = cfg.get("image_processor_type", cfg.get("feature_extractor_type", ""))
        if "ImageProcessor" not in kind and "FeatureExtractor" not in kind or "Whisper" in kind:
            raise ProcessorError(f"{path}: {PREPROCESSOR_FILE} is for {kind or 'an unknown processor'}, not an image "
                                 f"processor")
        size = cfg.get("size", {"shortest_edge": 224})
        shortest, hw = None, None
        if isinstance(size, dict) and "shortest_edge" in size:
            shortest = int(size["shortest_edge"])
        else:
            hw = _hw(size, "size")
        crop = _hw(cfg.get("crop_size", {"height": 224, "width": 224}), "crop_size")
        return cls(shortest_edge=shortest, resize_hw=hw, do_resize=bool(cfg.get("do_resize", True)),
                   resample=int(cfg.get("resample", 3)), do_center_crop=bool(cfg.get("do_center_crop", True)),
                   crop_hw=crop, do_rescale=bool(cfg.get("do_rescale", True)),
                   rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
                   do_normalize=bool(cfg.get("do_normalize", True)),
                   image_mean=tuple(float(v) for v in cfg.get("image_mean", cls.image_mean)),
                   image_std=tuple(float(v) for v in cfg.get("image_std", cls.image_std)),
                   do_convert_rgb=bool(cfg.get("do_convert_rgb", True)))

    @property
    def output_hw(self) -> tuple[int, int] | None:
        """(height, width) of every output, when fixed by the crop or an exact resize."""
        return self.crop_hw if self.do_center_crop else self.resize_hw if self.do_resize else None

    def _resize_hw(self, h: int, w: int) -> tuple[int, int]:
        if self.resize_hw is not None:
            return self.resize_hw
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if w <= h else (new_short, new_long)

    def __call__(self, image) -> torch.Tensor:
        """A Pillow image (or encoded bytes) -> ``[C, H, W]`` float32."""
        from PIL import Image

        if isinstance(image, (bytes, bytearray)):
            image = Image.open(io.BytesIO(image))
            image.load()
        if self.do_convert_rgb and image.mode != "RGB":
            image = _to_rgb(image)
        if self.do_resize:
            h, w = self._resize_hw(image.height, image.width)
            image = image.resize((w, h), resample=self.resample, reducing_gap=None)
        arr = np.array(image)
        arr = arr[None] if arr.ndim == 2 else np.moveaxis(arr, -1, 0)  # [C, H, W]
        if self.do_center_crop:
            arr = _center_crop(arr, *self.crop_hw)
        x = arr.astype(np.float64) * self.rescale_factor if self.do_rescale else arr
        x = x.astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.image_mean, dtype=np.float32)[:, None, None]
            std = np.array(self.image_std, dtype=np.float32)[:, None, None]
            x = (x - mean) / std
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def _to_rgb(image):
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image).convert("RGB")
    return image.convert("RGB")


def _center_crop(arr: np.ndarray, ch: int, cw: int) -> np.ndarray:
    _, h, w = arr.shape
    top, left = (h - ch) // 2, (w - cw) // 2
    if top >= 0 and left >= 0 and top + ch <= h and left + cw <= w:
        return arr[:, top:top + ch, left:left + cw]
    out = np.zeros((arr.shape[0], max(h, ch), max(w, cw)), dtype=arr.dtype)  # smaller: pad, then crop
    top_pad, left_pad = (max(h, ch) - h) // 2, (max(w, cw) - w) // 2
    out[:, top_pad:top_pad + h, left_pad:left_pad + w] = arr
    top, left = (out.shape[1] - ch) // 2, (out.shape[2] - cw) // 2
    return out[:, top:top + ch, left:left + cw]


# ------------------------------------------------------------------------------------------ audio


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    mels = 3.0 * f / 200.0
    log = f >= 1000.0
    mels[log] = 15.0 + np.log(f[log] / 1000.0) * (27.0 / np.log(6.4))
    return mels


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    f = 200.0 * m / 3.0
    log = m >= 15.0
    f[log] = 1000.0 * np.exp(np.log(6.4) * (m[log] - 15.0) / 27.0)
    return f


def slaney_mel_filters(num_mels: int, n_fft: int, sample_rate: int, f_max: float = 8000.0) -> np.ndarray:
    """Triangular filters evenly spaced on the Slaney mel scale over [0, f_max], each scaled to unit area
    (Slaney normalisation): ``[n_fft // 2 + 1, num_mels]``."""
    fft_freqs = np.linspace(0, sample_rate // 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(np.array([0.0]))[0], _hz_to_mel(np.array([f_max]))[0], num_mels + 2))
    diff = np.diff(edges)
    slopes = edges[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    return filters * (2.0 / (edges[2:num_mels + 2] - edges[:num_mels]))[None, :]


@dataclass(frozen=True)
class LogMelExtractor:
    feature_size: int = 80
    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400

    @classmethod
    def from_pretrained(cls, path: str | Path) -> LogMelExtractor:
        cfg = read_preprocessor_config(path)
        kind = cfg.get("feature_extractor_type", "")
        if kind != "WhisperFeatureExtractor":
            raise ProcessorError(f"{path}: {PREPROCESSOR_FILE} is for {kind or 'an unknown processor'}; audio front "
                                 f"ends take WhisperFeatureExtractor settings")
        if float(cfg.get("dither", 0.0)) != 0.0:
            raise ProcessorError(f"{path}: dither {cfg['dither']} adds random noise; deterministic data needs 0")
        return cls(feature_size=int(cfg.get("feature_size", 80)), sampling_rate=int(cfg.get("sampling_rate", 16000)),
                   hop_length=int(cfg.get("hop_length", 160)), n_fft=int(cfg.get("n_fft", 400)))

    def __call__(self, waveform: torch.Tensor, sample_rate: int, frames: int) -> torch.Tensor:
        """A mono waveform -> ``[feature_size, frames]`` log-mel features (float32)."""
        if sample_rate != self.sampling_rate:
            raise ProcessorError(f"audio sampled at {sample_rate} Hz; the model's feature extractor expects "
                                 f"{self.sampling_rate} Hz (resample the data)")
        if waveform.ndim != 1 or waveform.numel() == 0:
            raise ProcessorError(f"audio must be a non-empty mono waveform, got shape {tuple(waveform.shape)}")
        n = frames * self.hop_length
        x = waveform.to(torch.float32)[:n]
        x = torch.nn.functional.pad(x, (0, n - x.numel()))
        stft = torch.stft(x, self.n_fft, self.hop_length, window=torch.hann_window(self.n_fft), return_complex=True)
        power = stft[..., :-1].abs() ** 2
        filters = torch.from_numpy(slaney_mel_filters(self.feature_size, self.n_fft, self.sampling_rate)).float()
        log_spec = torch.clamp(filters.T @ power, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return ((log_spec + 4.0) / 4.0).contiguous()
