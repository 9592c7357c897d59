#!/usr/bin/env python
"""Pack raw paired files (images, audio, text, numpy arrays) into tar shards for one task of a workload.

The input folder holds one file per sample and field, named ``<key>.<field>.<ext>`` where ``field`` is the
module the file feeds (WebDataset naming), e.g.::

    raw/0001.vision.jpg  raw/0001.text.txt  raw/0002.vision.jpg  raw/0002.text.txt ...

or --input is WebDataset tar shards (.tar files, or folders of them, as img2dataset writes): members
``<key>.<suffix>``, a sample's files adjacent, read as streams. --field-map SUFFIX=FIELD names the field of each
suffix (``--field-map jpg=vision txt=text``; members of other suffixes, such as ``json``, are left out); without
it the suffixes must be ``<field>.<ext>``.

--workers N checks the samples on N processes (as Megatron-LM's preprocess_data.py --workers), one core each, the
shards the same as with one; it pays where decoding is single-threaded (Pillow's JPEG decoding) and cores are
many. A large corpus also builds in parts at once, one build per range of shards, e.g. ``--input
shards/000{0..4}*.tar --output vt/part0``; training reads a task's parts in order as one dataset:
``--data-path vision_text=vt/part0 vision_text=vt/part1 ...``.

Extensions: .jpg/.jpeg/.png/.bmp/.webp (Pillow), .wav (PCM), .txt (UTF-8), .npy. With --workload and --task every
sample is decoded once as training will decode it (resized image, log-mel features, tokens; with the same
--tokenizer-type / --tokenizer-model / --image-processor / --audio-processor as training), so bad files are
reported now, by name, not mid-training. The output folder is written under a temporary name and renamed at
the end: an interrupted build leaves nothing half-written, and an existing dataset is only replaced with
--overwrite.

--store-decoded [FIELD ...] keeps what that decoding gives (as Megatron-LM's preprocess_data.py tokenizes once):
the fields named (all without names) are stored as .npy arrays of the front end's input, so training loads them
instead of decoding each sample every epoch. Worth it where decoding is dear and the array is not much larger than
the file: log-mel features (15 ms per CLIP audio sample on one core, as large as the WAV), token ids. An image is
12-30x its JPEG as float32 (602 KB at 3x224x224) for 1.2 ms saved. The arrays are the decoding of this build's
preprocessing flags: train with the same --tokenizer-* flags, whose padding id marks the LM labels to ignore.

Example:
    python tools/build_multitask_dataset.py --input raw/ --output data/vision_text \\
        --workload tiny-clip --task vision_text --samples-per-shard 1000
"""

import os
import shutil
import sys
import time
from pathlib import Path

from megatron_spindle.arguments import build_parser
from megatron_spindle.errors import exit_on_user_error


def add_input_args(parser):
    g = parser.add_argument_group("input")
    g.add_argument("--input", required=True, nargs="+", help="Folder of raw files named <key>.<field>.<ext>, or "
                   "WebDataset .tar shards (.tar files and folders of them, read in the order given).")
    g.add_argument("--workload", default=None, help="Workload YAML or built-in name: check fields and decoding.")
    g.add_argument("--task", default=None, help="The task of --workload the data is for.")
    g.add_argument("--field-map", action="extend", nargs="+", default=[], metavar="SUFFIX=FIELD",
                   help="WebDataset input: the field each member suffix feeds, e.g. jpg=vision txt=text (members of "
                        "other suffixes are left out).")
    return parser


def add_output_args(parser):
    g = parser.add_argument_group("output")
    g.add_argument("--output", required=True, help="Dataset folder to write (index.json, samples.npy, shard-*.tar).")
    g.add_argument("--samples-per-shard", type=int, default=1000, help="Samples per tar shard.")
    g.add_argument("--overwrite", action="store_true", help="Replace an existing dataset at --output.")
    g.add_argument("--workers", type=int, default=1,
                   help="Processes that check (decode) the samples in parallel, as Megatron-LM's "
                        "preprocess_data.py --workers; the shards are the same as with one.")
    g.add_argument("--store-decoded", nargs="*", metavar="FIELD", default=None,
                   help="Store these fields (every field without names) decoded, as the front end's input in .npy, "
                        "so training loads arrays instead of decoding them every time (needs --workload, --task).")
    g.add_argument("--quiet", action="store_true", help="No progress lines.")
    return parser


def raw_samples(args):
    """(number of samples or None when not known ahead, iterator of (key, {field: RawFile})) of --input."""
    from megatron_spindle.data.shards import DatasetError
    from megatron_spindle.data.sources import folder_samples, parse_field_map, tar_samples, tar_shards

    field_map = parse_field_map(args.field_map)
    found = [(Path(p), tar_shards(Path(p))) for p in args.input]
    folders = [p for p, shards in found if shards is None]
    if folders:
        if len(args.input) > 1:
            raise DatasetError(f"--input {folders[0]} is a folder of raw files: give one such folder, or only "
                               ".tar shards and folders of them")
        if field_map:
            raise DatasetError(f"--field-map is for WebDataset .tar input; {folders[0]} is a folder of raw files")
        return folder_samples(folders[0])
    return None, tar_samples([s for _, shards in found for s in shards], field_map)


def stored_fields(names, fields, task) -> set[str]:
    """The fields --store-decoded names (every one of the task's when it names none; none without the flag)."""
    from megatron_spindle.data.shards import DatasetError

    if names is None:
        return set()
    unknown = sorted(set(names) - set(fields))
    if unknown:
        raise DatasetError(f"--store-decoded: task '{task}' has no field(s) {unknown} (its fields: {sorted(fields)})")
    return set(names or fields)


def with_fields(samples, want: list[str] | None, task: str | None):
    """The samples, each checked to have the task's fields (without a task: the first sample's)."""
    from megatron_spindle.data.shards import DatasetError

    first = None
    for key, files in samples:
        if want is None:
            first, want = key, sorted(files)
        if sorted(files) != want:
            raise DatasetError(f"sample '{key}' has fields {sorted(files)}, expected {want}"
                               + (f" (the front ends of task '{task}')" if first is None else
                                  f" (as sample '{first}')"))
        yield key, files


class BuildProgress:
    """A line every tenth of the samples when their number is known, else every PROGRESS_SECONDS."""

    PROGRESS_SECONDS = 10.0

    def __init__(self, total: int | None, quiet: bool):
        self.total, self.quiet, self.done = total, quiet, 0
        self.t0 = self.last = time.perf_counter()

    def sample(self, shards: int) -> None:
        self.done += 1
        now = time.perf_counter()
        if self.quiet:
            return
        if self.total is not None:
            due = self.done % max(1, self.total // 10) == 0 or self.done == self.total
            count = f"{self.done}/{self.total}"
        else:
            due, count = now - self.last >= self.PROGRESS_SECONDS, str(self.done)
        if due:
            self.last = now
            print(f"[build] {count} samples, {shards} shard(s), {now - self.t0:.1f} s", flush=True)


def main(argv=None, extra_args_provider=None):
    from megatron_spindle.data.preprocess import add_preprocessing_args

    parser = build_parser(__doc__.strip().splitlines()[0], [add_input_args, add_output_args, add_preprocessing_args],
                          extra_args_provider)
    args = parser.parse_args(argv)
    if (args.workload is None) != (args.task is None):
        parser.error("--workload and --task go together")
    if args.store_decoded is not None and args.workload is None:
        parser.error("--store-decoded needs --workload and --task (the front ends' decoding)")
    if args.samples_per_shard <= 0:
        parser.error(f"--samples-per-shard must be positive, got {args.samples_per_shard}")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.workers > 1 and args.workload is None:
        parser.error("--workers checks samples in parallel: it needs --workload and --task (nothing is decoded "
                     "without them)")
    with exit_on_user_error():
        from megatron_spindle.data.build import SampleCheck, checked_samples
        from megatron_spindle.data.datasets import task_fields
        from megatron_spindle.data.shards import INDEX_FILE, DatasetError, ShardWriter
        from megatron_spindle.graph.workload import load_workload

        out = Path(args.output)
        if out.exists() and not args.overwrite:
            raise DatasetError(f"output {out} already exists (give --overwrite to replace it)")
        n, samples = raw_samples(args)
        check = None
        if args.workload:
            workload = load_workload(args.workload)
            try:
                workload.task(args.task)
            except KeyError:
                raise DatasetError(f"workload '{workload.name}' has no task '{args.task}' "
                                   f"(tasks: {[t.name for t in workload.tasks]})") from None
            from megatron_spindle.data.preprocess import preprocessing_from_args

            fields = task_fields(workload, args.task)
            check = SampleCheck(workload, args.task, preprocessing_from_args(args, workload),
                                stored_fields(args.store_decoded, fields, args.task))
        samples = with_fields(samples, sorted(check.fields) if check else None, args.task)
        if check is not None:
            samples = checked_samples(samples, check, args, args.workers)
        else:
            samples = ((key, {f: (r.ext, r.data) for f, r in files.items()}) for key, files in samples)
        tmp = out.with_name(f".{out.name}.building")
        if tmp.exists():
            shutil.rmtree(tmp)
        writer = ShardWriter(tmp, args.samples_per_shard)
        progress = BuildProgress(n, args.quiet)
        try:
            for key, raw in samples:
                writer.write(key, raw)
                progress.sample(len(writer.shards))
            writer.close()
            if out.exists():
                old = out.with_name(f".{out.name}.old")
                os.replace(out, old)
                os.replace(tmp, out)
                shutil.rmtree(old)
            else:
                os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        print(f"wrote {writer.num_samples} samples in {len(writer.shards)} shard(s) to {out} (fields: "
              f"{', '.join(f'{f}.{e}' for f, e in writer.fields.items())}; index {out / INDEX_FILE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
