// A video file through FFmpeg: libavformat demuxes, libavcodec decodes, libswscale turns
// each kept frame into RGB24 (video_file.h).
extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/pixdesc.h>
#include <libswscale/swscale.h>
}

#include <cmath>
#include <memory>

#include "vision/codecs.h"
#include "vision/video_file.h"

namespace msa::vision::detail {
namespace {

std::string av_error_text(int code) {
  char text[AV_ERROR_MAX_STRING_SIZE] = {};
  av_strerror(code, text, sizeof text);
  return text;
}

struct FormatDeleter {
  void operator()(AVFormatContext* format) const { avformat_close_input(&format); }
};
struct CodecDeleter {
  void operator()(AVCodecContext* codec) const { avcodec_free_context(&codec); }
};
struct PacketDeleter {
  void operator()(AVPacket* packet) const { av_packet_free(&packet); }
};
struct FrameDeleter {
  void operator()(AVFrame* frame) const { av_frame_free(&frame); }
};
struct ScaleDeleter {
  void operator()(SwsContext* scale) const { sws_freeContext(scale); }
};
using FormatPtr = std::unique_ptr<AVFormatContext, FormatDeleter>;
using PacketPtr = std::unique_ptr<AVPacket, PacketDeleter>;
using FramePtr = std::unique_ptr<AVFrame, FrameDeleter>;

struct OpenedVideo {
  FormatPtr format;
  int stream = -1;
  const AVCodec* decoder = nullptr;
};

OpenedVideo open_video(const std::string& path, const std::string& name) {
  AVFormatContext* raw = nullptr;
  int rc = avformat_open_input(&raw, path.c_str(), nullptr, nullptr);
  if (rc < 0) throw Error(name + ": cannot open it as a video (FFmpeg: " + av_error_text(rc) + ")");
  OpenedVideo video;
  video.format.reset(raw);
  rc = avformat_find_stream_info(raw, nullptr);
  if (rc < 0) throw Error(name + ": cannot read its streams (FFmpeg: " + av_error_text(rc) + ")");
  video.stream = av_find_best_stream(raw, AVMEDIA_TYPE_VIDEO, -1, -1, &video.decoder, 0);
  if (video.stream == AVERROR_DECODER_NOT_FOUND)
    throw Error(name + ": FFmpeg has no decoder for its video stream");
  if (video.stream < 0) throw Error(name + ": no video stream (expected a video file)");
  return video;
}

// The container's average frame rate, else its nominal one.
double stream_fps(const AVStream* stream) {
  for (const AVRational rate : {stream->avg_frame_rate, stream->r_frame_rate})
    if (rate.num > 0 && rate.den > 0) return av_q2d(rate);
  return 0;
}

// Stream-info for the chooser: frames counted by demuxing every packet of the stream (the
// containers' frame counts are often missing or estimates).
VideoStreamInfo count_frames(const std::string& path, const std::string& name) {
  OpenedVideo video = open_video(path, name);
  const AVStream* stream = video.format->streams[video.stream];
  VideoStreamInfo info;
  info.width = stream->codecpar->width;
  info.height = stream->codecpar->height;
  PacketPtr packet(av_packet_alloc());
  if (!packet) throw Error(name + ": out of memory");
  int rc;
  while ((rc = av_read_frame(video.format.get(), packet.get())) >= 0) {
    if (packet->stream_index == video.stream && packet->size > 0) ++info.frames;
    av_packet_unref(packet.get());
  }
  if (rc != AVERROR_EOF) throw Error(name + ": read error (FFmpeg: " + av_error_text(rc) + ")");
  info.fps = stream_fps(stream);
  if (info.fps <= 0 && video.format->duration > 0 && info.frames > 0)
    info.fps = static_cast<double>(info.frames) /
               (static_cast<double>(video.format->duration) / AV_TIME_BASE);
  return info;
}

// libswscale's YUV -> RGB coefficients and input range for the frame's colour tags
// (BT.601 where they are missing, as FFmpeg's own default).
void set_colorspace(SwsContext* scale, const AVFrame* frame) {
  const int matrix = frame->colorspace == AVCOL_SPC_BT709       ? SWS_CS_ITU709
                     : frame->colorspace == AVCOL_SPC_FCC       ? SWS_CS_FCC
                     : frame->colorspace == AVCOL_SPC_SMPTE240M ? SWS_CS_SMPTE240M
                     : frame->colorspace == AVCOL_SPC_BT2020_NCL || frame->colorspace == AVCOL_SPC_BT2020_CL
                         ? SWS_CS_BT2020
                         : SWS_CS_ITU601;
  const auto format = static_cast<AVPixelFormat>(frame->format);
  const bool full_range = frame->color_range == AVCOL_RANGE_JPEG || format == AV_PIX_FMT_YUVJ420P ||
                          format == AV_PIX_FMT_YUVJ422P || format == AV_PIX_FMT_YUVJ444P ||
                          format == AV_PIX_FMT_YUVJ440P || format == AV_PIX_FMT_YUVJ411P;
  sws_setColorspaceDetails(scale, sws_getCoefficients(matrix), full_range ? 1 : 0,
                           sws_getCoefficients(SWS_CS_DEFAULT), 1, 0, 1 << 16, 1 << 16);
}

class RgbConverter {
 public:
  RgbConverter(std::string name, const DecodeLimits& limits) : name_(std::move(name)), limits_(limits) {}

  Rgb8Image convert(const AVFrame* frame) {
    check_image_size(frame->width, frame->height, name_, limits_);
    if (width_ == 0) {
      width_ = frame->width;
      height_ = frame->height;
    } else if (frame->width != width_ || frame->height != height_) {
      throw Error(name_ + ": the frame size changes from " + std::to_string(width_) + "x" +
                  std::to_string(height_) + " to " + std::to_string(frame->width) + "x" +
                  std::to_string(frame->height) + " (expected one size)");
    }
    const auto format = static_cast<AVPixelFormat>(frame->format);
    // The same size in and out: only the pixel format changes. Accurate rounding and full
    // chroma interpolation for the YUV -> RGB step.
    SwsContext* next = sws_getCachedContext(scale_.release(), frame->width, frame->height, format,
                                            frame->width, frame->height, AV_PIX_FMT_RGB24,
                                            SWS_BICUBIC | SWS_ACCURATE_RND | SWS_FULL_CHR_H_INT,
                                            nullptr, nullptr, nullptr);
    scale_.reset(next);
    if (!next) {
      const char* format_name = av_get_pix_fmt_name(format);
      throw Error(name_ + ": cannot convert its pixel format " +
                  std::string(format_name ? format_name : "unknown") + " to RGB");
    }
    set_colorspace(next, frame);
    Rgb8Image image;
    image.width = frame->width;
    image.height = frame->height;
    image.rgb.resize(static_cast<size_t>(image.width * image.height * 3));
    uint8_t* planes[4] = {image.rgb.data(), nullptr, nullptr, nullptr};
    int strides[4] = {static_cast<int>(image.width * 3), 0, 0, 0};
    const int rows = sws_scale(next, frame->data, frame->linesize, 0, frame->height, planes, strides);
    if (rows != frame->height)
      throw Error(name_ + ": libswscale converted " + std::to_string(rows) + " of " +
                  std::to_string(frame->height) + " rows");
    return image;
  }

 private:
  std::string name_;
  const DecodeLimits& limits_;
  std::unique_ptr<SwsContext, ScaleDeleter> scale_;
  int width_ = 0, height_ = 0;
};

}  // namespace

void read_video_file(const std::string& path, const std::string& name, const DecodeLimits& limits,
                     const std::function<std::vector<int64_t>(const VideoStreamInfo&)>& choose,
                     const std::function<void(int64_t index, Rgb8Image frame)>& keep) {
  const VideoStreamInfo info = count_frames(path, name);
  if (info.frames == 0) throw Error(name + ": the video has no frames");
  check_image_size(info.width, info.height, name, limits);
  if (!(info.fps > 0) || !std::isfinite(info.fps))
    throw Error(name + ": the video states no frame rate and no duration");
  const std::vector<int64_t> wanted = choose(info);
  if (wanted.empty()) return;

  // The second pass opens the file again: rewinding by seeking is not reliable for every
  // container (and not possible for some).
  OpenedVideo video = open_video(path, name);
  std::unique_ptr<AVCodecContext, CodecDeleter> codec(avcodec_alloc_context3(video.decoder));
  if (!codec) throw Error(name + ": out of memory");
  int rc = avcodec_parameters_to_context(codec.get(), video.format->streams[video.stream]->codecpar);
  if (rc < 0) throw Error(name + ": bad codec parameters (FFmpeg: " + av_error_text(rc) + ")");
  codec->thread_count = 0;  // the decoder's own threads, as many as it finds useful
  rc = avcodec_open2(codec.get(), video.decoder, nullptr);
  if (rc < 0) throw Error(name + ": cannot open the decoder (FFmpeg: " + av_error_text(rc) + ")");

  PacketPtr packet(av_packet_alloc());
  FramePtr frame(av_frame_alloc());
  FramePtr last(av_frame_alloc());  // a reference to the latest decoded frame
  if (!packet || !frame || !last) throw Error(name + ": out of memory");
  RgbConverter converter(name, limits);
  int64_t decoded = 0;
  size_t next = 0;
  // Takes every frame the decoder has ready; false once every wanted frame is kept.
  const auto drain = [&]() {
    int got;
    while ((got = avcodec_receive_frame(codec.get(), frame.get())) >= 0) {
      if (next < wanted.size() && decoded == wanted[next]) {
        keep(decoded, converter.convert(frame.get()));
        ++next;
      }
      ++decoded;
      av_frame_unref(last.get());
      av_frame_move_ref(last.get(), frame.get());
      if (next == wanted.size()) return false;
    }
    if (got != AVERROR(EAGAIN) && got != AVERROR_EOF)
      throw Error(name + ": corrupt video data (FFmpeg: " + av_error_text(got) + ")");
    return true;
  };
  bool more = true;
  while (more && (rc = av_read_frame(video.format.get(), packet.get())) >= 0) {
    if (packet->stream_index == video.stream) {
      // A damaged packet (AVERROR_INVALIDDATA) is skipped, as players do; the frame count
      // then falls short, which the end of this function covers.
      const int sent = avcodec_send_packet(codec.get(), packet.get());
      if (sent < 0 && sent != AVERROR(EAGAIN) && sent != AVERROR_INVALIDDATA)
        throw Error(name + ": corrupt video data (FFmpeg: " + av_error_text(sent) + ")");
      more = drain();
    }
    av_packet_unref(packet.get());
  }
  if (more) {
    if (rc != AVERROR_EOF) throw Error(name + ": read error (FFmpeg: " + av_error_text(rc) + ")");
    avcodec_send_packet(codec.get(), nullptr);  // flush the frames the decoder holds back
    drain();
  }
  if (decoded == 0) throw Error(name + ": no frame of the video could be decoded");
  // A damaged stream that decoded to fewer frames than it has packets: its last frame
  // stands in for the chosen ones beyond its end.
  for (; next < wanted.size(); ++next) keep(wanted[next], converter.convert(last.get()));
}

}  // namespace msa::vision::detail
