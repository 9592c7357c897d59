"""Raw file bytes -> the tensors the front ends need (images, audio, text, numpy arrays).

- images (.jpg/.jpeg/.png/.bmp/.webp, Pillow): converted to RGB (3 channels) or L (1 channel), resized to
  ``image_size`` x ``image_size`` (bilinear), scaled to [0, 1] then normalised to [-1, 1]: ``[C, S, S]`` float32.
- audio (.wav, the standard library's ``wave``; 8/16/24/32-bit PCM, any rate, mixed down to mono): a log-mel-like
  spectrogram ``[bins, frames]``: ``torch.stft`` (Hann window, ``n_fft`` = the power of two >= 4 * bins, hop
  ``n_fft // 2``) -> power -> ``bins`` triangular filters evenly spaced on the mel scale -> ``log(x + 1e-6)``;
  cut or padded (with the log floor) to ``frames`` frames. Sample rates are not converted.
- text (.txt, UTF-8): the byte-level tokenizer (data/tokenizer.py), cut or padded to the token count.
- arrays (.npy, numpy, ``allow_pickle=False``): taken as they are; audio given as a 1-D waveform array becomes
  features as above (at 16 kHz).
"""

from __future__ import annotations

import io
import math
import wave

import numpy as np
import torch

from megatron_spindle.data.tokenizer import ByteTokenizer

IMAGE_EXTS = ("jpg", "jpeg", "png", "bmp", "webp")
AUDIO_EXTS = ("wav",)
TEXT_EXTS = ("txt",)
ARRAY_EXTS = ("npy",)
KNOWN_EXTS = IMAGE_EXTS + AUDIO_EXTS + TEXT_EXTS + ARRAY_EXTS
LOG_FLOOR = 1e-6
DEFAULT_SAMPLE_RATE = 16000


class DecodeError(ValueError):
    """A raw file that cannot be turned into the tensor its front end needs."""


def decode_image(data: bytes, image_size: int, channels: int) -> torch.Tensor:
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError) as e:
        raise DecodeError(f"not a readable image: {e}") from None
    if channels not in (1, 3):
        raise DecodeError(f"images decode to 1 or 3 channels, the front end wants {channels}")
    img = img.convert("L" if channels == 1 else "RGB")
    if img.size != (image_size, image_size):
        img = img.resize((image_size, image_size), Image.BILINEAR)
    arr = np.asarray(img, dtype=np.float32) / 255.0
    if channels == 1:
        arr = arr[None]
    else:
        arr = arr.transpose(2, 0, 1)
    return torch.from_numpy(np.ascontiguousarray(arr) * 2.0 - 1.0)


def read_wav(data: bytes) -> tuple[torch.Tensor, int]:
    """Mono float32 waveform in [-1, 1] and its sample rate."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            width, nch, rate, n = w.getsampwidth(), w.getnchannels(), w.getframerate(), w.getnframes()
            raw = w.readframes(n)
    except (wave.Error, EOFError) as e:
        raise DecodeError(f"not a readable PCM wav file: {e}") from None
    if width == 1:
        x = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        v = np.where(v >= 1 << 23, v - (1 << 24), v)
        x = v.astype(np.float32) / float(1 << 23)
    elif width == 4:
        x = np.frombuffer(raw, dtype="<i4").astype(np.float32) / float(1 << 31)
    else:
        raise DecodeError(f"unsupported wav sample width {width} bytes")
    x = x.reshape(-1, nch).mean(axis=1) if nch > 1 else x
    return torch.from_numpy(np.ascontiguousarray(x)), rate


def _mel(f):
    return 2595.0 * np.log10(1.0 + f / 700.0)


def _mel_inv(m):
    return 700.0 * (10.0 ** (m / 2595.0) - 1.0)


def mel_filterbank(bins: int, n_fft: int, sample_rate: int) -> torch.Tensor:
    """``bins`` triangular filters evenly spaced on the mel scale over [0, rate/2]: ``[bins, n_fft//2 + 1]``."""
    freqs = np.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1)
    edges = _mel_inv(np.linspace(_mel(0.0), _mel(sample_rate / 2.0), bins + 2))
    fb = np.zeros((bins, len(freqs)), dtype=np.float32)
    for i in range(bins):
        lo, mid, hi = edges[i], edges[i + 1], edges[i + 2]
        up = (freqs - lo) / max(mid - lo, 1e-9)
        down = (hi - freqs) / max(hi - mid, 1e-9)
        fb[i] = np.clip(np.minimum(up, down), 0.0, None)
        if fb[i].sum() == 0:  # narrower than one FFT bin: take the nearest bin
            fb[i, int(np.argmin(np.abs(freqs - mid)))] = 1.0
    return torch.from_numpy(fb)


def log_mel_features(waveform: torch.Tensor, sample_rate: int, bins: int, frames: int) -> torch.Tensor:
    if waveform.ndim != 1 or waveform.numel() == 0:
        raise DecodeError(f"audio must be a non-empty mono waveform, got shape {tuple(waveform.shape)}")
    n_fft = 1 << max(4, math.ceil(math.log2(4 * bins)))
    hop = n_fft // 2
    x = waveform.to(torch.float32)
    if x.numel() < n_fft:
        x = torch.nn.functional.pad(x, (0, n_fft - x.numel()))
    spec = torch.stft(x, n_fft=n_fft, hop_length=hop, window=torch.hann_window(n_fft), center=True,
                      return_complex=True)
    power = spec.abs() ** 2  # [n_fft//2 + 1, T]
    feats = torch.log(mel_filterbank(bins, n_fft, sample_rate) @ power + LOG_FLOOR)
    if feats.shape[1] >= frames:
        return feats[:, :frames].contiguous()
    pad = torch.full((bins, frames - feats.shape[1]), math.log(LOG_FLOOR))
    return torch.cat([feats, pad], dim=1)


def encode_npy(x: torch.Tensor) -> bytes:
    """A decoded field as .npy bytes (tools/build_multitask_dataset.py --store-decoded): token ids as int32,
    features and pixels as float32, which ``decode_field`` reads back as the same int64 / float32 tensor."""
    buf = io.BytesIO()
    np.save(buf, x.numpy().astype(np.float32 if x.is_floating_point() else np.int32))
    return buf.getvalue()


def decode_npy(data: bytes) -> torch.Tensor:
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DecodeError(f"not a readable .npy array: {e}") from None
    if arr.dtype.kind not in "fiub":
        raise DecodeError(f"array of dtype {arr.dtype} is not numeric")
    return torch.from_numpy(np.ascontiguousarray(arr))


def decode_text(data: bytes, tokenizer: ByteTokenizer, length: int) -> torch.Tensor:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DecodeError(f"text is not UTF-8: {e}") from None
    return tokenizer.encode(text.strip(), length)
