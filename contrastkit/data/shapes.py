"""Synthetic images of coloured shapes, generated deterministically: the embedded default image data.

Each image shows one shape (the class) with nuisances: colour, size, position, texture and a noisy
background. ``caption`` describes the image in words, so the same generator serves image-text (CLIP)
and image-only (SimCLR/MoCo) recipes. Everything derives from a seed; nothing is downloaded.

>>> spec = sample_spec(random.Random(0))
>>> image = render(spec, size=64, seed=0)       # PIL.Image, RGB
>>> caption(spec)                              # e.g. 'a small striped red star in the top left'
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle", "star", "cross", "hexagon", "diamond", "crescent")
COLORS = {
    "red": (215, 48, 39), "orange": (244, 140, 30), "yellow": (240, 220, 50), "green": (50, 160, 70),
    "blue": (40, 90, 210), "purple": (130, 60, 180), "pink": (240, 120, 180), "white": (245, 245, 245),
}
SIZES = ("small", "large")
POSITIONS = ("top left", "top right", "bottom left", "bottom right", "center")
TEXTURES = ("plain", "striped", "dotted")


@dataclass(frozen=True)
class ShapeSpec:
    shape: str
    color: str
    size: str
    position: str
    texture: str


def sample_spec(rng: random.Random, shapes: tuple[str, ...] = SHAPES) -> ShapeSpec:
    """A random spec; ``shapes`` restricts the classes drawn from."""
    return ShapeSpec(rng.choice(shapes), rng.choice(list(COLORS)), rng.choice(SIZES), rng.choice(POSITIONS),
                     rng.choice(TEXTURES))


def caption(spec: ShapeSpec) -> str:
    """A sentence describing the image, e.g. 'a large dotted blue hexagon in the center'."""
    texture = "" if spec.texture == "plain" else f"{spec.texture} "
    return f"a {spec.size} {texture}{spec.color} {spec.shape} in the {spec.position}"


def _outline(shape: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    def polygon(k, radii, offset=0.0):
        pts = []
        for i in range(k * len(radii)):
            a = angle + offset + 2 * math.pi * i / (k * len(radii))
            rr = r * radii[i % len(radii)]
            pts.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
        return pts

    if shape == "square":
        return polygon(4, [1.0], math.pi / 4)
    if shape == "triangle":
        return polygon(3, [1.0], -math.pi / 2)
    if shape == "star":
        return polygon(5, [1.0, 0.45], -math.pi / 2)
    if shape == "hexagon":
        return polygon(6, [1.0])
    if shape == "diamond":
        return [(cx, cy - r), (cx + 0.6 * r, cy), (cx, cy + r), (cx - 0.6 * r, cy)]
    if shape == "cross":
        w = 0.35 * r
        pts = [(-w, -r), (w, -r), (w, -w), (r, -w), (r, w), (w, w), (w, r), (-w, r), (-w, w), (-r, w), (-r, -w),
               (-w, -w)]
        c, s = math.cos(angle), math.sin(angle)
        return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in pts]
    raise ValueError(f"no outline for shape {shape!r}")


def render(spec: ShapeSpec, size: int = 64, seed: int = 0, scale: float = 1.0, free_pose: bool = False) -> Image.Image:
    """Draw ``spec`` as an RGB image of ``size`` x ``size``; ``seed`` sets jitter, rotation and background.
    ``scale`` enlarges the shape (and pulls the position anchors towards the centre by the same factor).
    ``free_pose`` ignores the spec's size and position: the radius is uniform in [0.14, 0.27] x ``scale`` of
    the side, the centre uniform where the shape stays in the image, the rotation uniform over the circle."""
    rng = random.Random(seed)
    noise = np.random.default_rng(seed).normal(rng.randint(20, 110), rng.uniform(8, 30), (size, size))
    image = Image.fromarray(np.clip(noise, 0, 255).astype(np.uint8)).convert("RGB")
    if free_pose:
        radius = size * rng.uniform(0.14, 0.27) * scale
        margin = min(radius, size / 2)
        cx, cy = rng.uniform(margin, size - margin), rng.uniform(margin, size - margin)
    else:
        radius = size * (0.14 if spec.size == "small" else 0.27) * rng.uniform(0.9, 1.1) * scale
        anchors = {"top left": (0.28, 0.28), "top right": (0.72, 0.28), "bottom left": (0.28, 0.72),
                   "bottom right": (0.72, 0.72), "center": (0.5, 0.5)}
        fx, fy = anchors[spec.position]
        if scale != 1.0:
            fx, fy = 0.5 + (fx - 0.5) / scale, 0.5 + (fy - 0.5) / scale
        cx = size * fx + rng.uniform(-0.05, 0.05) * size
        cy = size * fy + rng.uniform(-0.05, 0.05) * size
    color = tuple(max(0, min(255, c + rng.randint(-20, 20))) for c in COLORS[spec.color])

    mask = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(mask)
    angle = rng.uniform(0, 2 * math.pi) if free_pose else rng.uniform(-0.3, 0.3)
    if spec.shape == "circle":
        draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=255)
    elif spec.shape == "crescent":
        draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=255)
        off = 0.45 * radius
        dx, dy = off, -off * 0.3  # the bite's offset, turned by the rotation in free pose
        if free_pose:
            dx, dy = dx * math.cos(angle) - dy * math.sin(angle), dx * math.sin(angle) + dy * math.cos(angle)
        draw.ellipse([cx - radius + dx, cy - radius + dy, cx + radius + dx, cy + radius + dy], fill=0)
    else:
        draw.polygon(_outline(spec.shape, cx, cy, radius, angle), fill=255)

    if spec.texture != "plain":
        pattern = Image.new("L", (size, size), 255)
        pd = ImageDraw.Draw(pattern)
        step = max(3, size // 12)
        if spec.texture == "striped":
            for x in range(-size, 2 * size, step):
                pd.line([(x, 0), (x + size, size)], fill=0, width=max(1, step // 3))
        else:
            for y in range(step // 2, size, step):
                for x in range(step // 2, size, step):
                    pd.ellipse([x - step / 5, y - step / 5, x + step / 5, y + step / 5], fill=0)
        mask = Image.composite(mask, mask.point(lambda v: v * 35 // 100), pattern)  # marks let the background through

    image.paste(Image.new("RGB", (size, size), color), (0, 0), mask)
    return image
