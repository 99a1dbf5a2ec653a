// Test videos written through FFmpeg's encoders (built where FFmpeg is; see
// tests/CMakeLists.txt): frames of RGB8 in, a file out.
#pragma once
extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libswscale/swscale.h>
}

#include <stdexcept>
#include <string>
#include <vector>

#include "msa/vision_media.h"

namespace msa::testing {

// Writes `frames` (all one size) at `fps` frames per second with the encoder `codec`
// ("rawvideo" stores RGB24 losslessly; "mpeg4" is YUV 4:2:0) into a `container` ("nut",
// "mp4", "avi") file. No frames: a file with a video stream and no packets.
inline void write_video_file(const std::string& path, const std::vector<vision::Rgb8Image>& frames,
                             int width, int height, int fps, const char* codec_name,
                             const char* container) {
  const auto check = [](int rc, const char* what) {
    if (rc < 0) throw std::runtime_error(std::string("write_video_file: ") + what + " failed");
  };
  AVFormatContext* format = nullptr;
  check(avformat_alloc_output_context2(&format, nullptr, container, path.c_str()), "output context");
  const AVCodec* codec = avcodec_find_encoder_by_name(codec_name);
  if (!codec) throw std::runtime_error(std::string("write_video_file: no encoder ") + codec_name);
  AVStream* stream = avformat_new_stream(format, nullptr);
  AVCodecContext* encoder = avcodec_alloc_context3(codec);
  encoder->width = width;
  encoder->height = height;
  encoder->time_base = AVRational{1, fps};
  encoder->framerate = AVRational{fps, 1};
  encoder->pix_fmt = std::string(codec_name) == "rawvideo" ? AV_PIX_FMT_RGB24 : AV_PIX_FMT_YUV420P;
  encoder->gop_size = 4;
  encoder->bit_rate = 4000000;
  if (format->oformat->flags & AVFMT_GLOBALHEADER) encoder->flags |= AV_CODEC_FLAG_GLOBAL_HEADER;
  check(avcodec_open2(encoder, codec, nullptr), "avcodec_open2");
  check(avcodec_parameters_from_context(stream->codecpar, encoder), "codec parameters");
  stream->time_base = encoder->time_base;
  stream->avg_frame_rate = encoder->framerate;
  check(avio_open(&format->pb, path.c_str(), AVIO_FLAG_WRITE), "avio_open");
  check(avformat_write_header(format, nullptr), "write header");

  AVPacket* packet = av_packet_alloc();
  const auto drain = [&]() {
    while (avcodec_receive_packet(encoder, packet) >= 0) {
      av_packet_rescale_ts(packet, encoder->time_base, stream->time_base);
      packet->stream_index = stream->index;
      check(av_interleaved_write_frame(format, packet), "write frame");
    }
  };
  SwsContext* scale = sws_getContext(width, height, AV_PIX_FMT_RGB24, width, height, encoder->pix_fmt,
                                     SWS_BICUBIC, nullptr, nullptr, nullptr);
  AVFrame* frame = av_frame_alloc();
  frame->format = encoder->pix_fmt;
  frame->width = width;
  frame->height = height;
  check(av_frame_get_buffer(frame, 0), "frame buffer");
  for (size_t i = 0; i < frames.size(); ++i) {
    check(av_frame_make_writable(frame), "frame writable");
    const uint8_t* planes[1] = {frames[i].rgb.data()};
    const int strides[1] = {width * 3};
    sws_scale(scale, planes, strides, 0, height, frame->data, frame->linesize);
    frame->pts = static_cast<int64_t>(i);
    check(avcodec_send_frame(encoder, frame), "send frame");
    drain();
  }
  avcodec_send_frame(encoder, nullptr);
  drain();
  check(av_write_trailer(format), "write trailer");
  av_frame_free(&frame);
  sws_freeContext(scale);
  av_packet_free(&packet);
  avcodec_free_context(&encoder);
  avio_closep(&format->pb);
  avformat_free_context(format);
}

}  // namespace msa::testing
